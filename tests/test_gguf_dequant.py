"""Row-chunked dequantisation gives exactly what dequantising whole tensors gives."""
import gguf
import numpy as np
import pytest
import torch

from slipstream.models.loading import gguf_loader
from slipstream.models.loading.gguf_loader import load_gguf

TYPES = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F16,
         gguf.GGMLQuantizationType.F32]


def write(path, arrays):
    """A GGUF of the tiny llama shape whose tensors are stored in the given types (others float32)."""
    from model_families import byte_vocab, hf_model, special_ids, write_gguf

    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    model = hf_model("llama", len(vocab.tokens), seed=3, bos=bos, eos=eos)
    write_gguf(path, "llama", model, vocab, pre="llama-bpe", quantize=arrays)
    return model


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_chunked_equals_whole(tmp_path, monkeypatch, qtype):
    path = tmp_path / f"{qtype.name}.gguf"
    write(path, {"token_embd.weight": qtype, "blk.0.ffn_down.weight": qtype, "output.weight": qtype})
    monkeypatch.setattr(gguf_loader, "DEQUANT_CHUNK_ROWS", 10**9)
    _, whole, _ = load_gguf(path)
    monkeypatch.setattr(gguf_loader, "DEQUANT_CHUNK_ROWS", 7)  # 403 rows: 57 full chunks and a ragged one
    _, chunked, _ = load_gguf(path)
    reader = gguf.GGUFReader(path)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    reference = np.array(gguf.quants.dequantize(embd.data, embd.tensor_type), dtype=np.float32)
    assert torch.equal(chunked["model.embed_tokens.weight"], torch.from_numpy(reference.reshape(403, 64)))
    for name in whole:
        assert torch.equal(whole[name], chunked[name]), name
