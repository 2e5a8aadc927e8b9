"""Moondream on the "triton" backend (what the engine sets on CUDA) computes the reference backend's
logits: the paged attention kernel with the bidirectional BOS + image prefix, here in Triton's
interpreter on CPU tensors (float32), the partial rotary and K/V write as torch ops (text.py)."""
import pytest
import torch

pytest.importorskip("triton")

from test_moondream_model import CFG, image_prompt, random_weights, sample_image  # noqa: E402

from slipstream.models.kernels.attention import AttentionMetadata, DeviceAttentionMetadata  # noqa: E402
from slipstream.models.base import ForwardBatch, KVCache  # noqa: E402
from slipstream.models.moondream.model import MoondreamForCausalLM  # noqa: E402

PAGE = 4
F32 = torch.float32


def _model(backend):
    weights = {k: v.to(F32) for k, v in random_weights(CFG, seed=0).items()}
    model = MoondreamForCausalLM.from_weights(CFG, weights, F32, "cpu")
    model.set_kernel_backend(backend)
    return model


def _step(seqs, chunks, embeds):
    """One step's batch. seqs: name -> (pages, tokens so far); chunks: (name, ids, prefix) in batch
    order; embeds: name -> {position: embedding}. Every token row is sampled."""
    ids, positions, kv_indices, rows, feats = [], [], [], [], []
    query_start, kv_lens, tables, prefixes = [0], [], [], []
    for name, chunk, prefix in chunks:
        pages, start = seqs[name]
        for i, tok in enumerate(chunk):
            p = start + i
            if p in embeds.get(name, {}):
                rows.append(len(ids))
                feats.append(embeds[name][p])
            ids.append(tok)
            positions.append(p)
            kv_indices.append(pages[p // PAGE] * PAGE + p % PAGE)
        seqs[name] = (pages, start + len(chunk))
        query_start.append(len(ids))
        kv_lens.append(start + len(chunk))
        tables.append(pages)
        prefixes.append(prefix)
    meta = AttentionMetadata(query_start, kv_lens, tables, PAGE, bidirectional_lens=prefixes)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta.on_device = DeviceAttentionMetadata(torch.tensor(query_start), torch.tensor(kv_lens), table,
                                             max(b - a for a, b in zip(query_start, query_start[1:])),
                                             bidirectional_lens=torch.tensor(prefixes))
    batch = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.tensor(positions),
                         kv_indices=torch.tensor(kv_indices), sample_indices=torch.arange(len(ids)), attn=meta)
    if rows:
        batch.embed_rows, batch.embeds = torch.tensor(rows), torch.stack(feats)
    return batch


def _run(model, image_ids, image_embeds):
    """Two steps: an image prompt (prefix in one chunk) beside a plain prompt and a second image
    prompt's prefix alone; then the first's decode, the plain prompt's next chunk and the second's
    text after its prefix."""
    prefix = CFG.prefix_len
    kv = KVCache(model.config, 24, PAGE, F32, "cpu")
    kv.k.fill_(float("nan"))  # attention must never read a slot no forward wrote
    kv.v.fill_(float("nan"))
    seqs = {"a": ([5, 2, 9, 0, 7, 11, 1], 0), "b": ([3, 8, 6], 0), "c": ([4, 10, 12, 13, 14, 15], 0)}
    embeds = {"a": image_embeds, "c": image_embeds}
    steps = [[("a", image_ids, prefix), ("b", [7, 8, 9, 10, 11], 0), ("c", image_ids[:prefix], prefix)],
             [("a", [42], prefix), ("b", [12, 13, 14], 0), ("c", image_ids[prefix:] + [50, 51], prefix)]]
    return [model(_step(seqs, chunks, embeds), kv) for chunks in steps]


def test_triton_backend_equals_reference_with_an_image_prefix():
    reference, triton_model = _model("reference"), _model("triton")
    assert triton_model.backend == "triton" and all(b.attn.backend == "triton" for b in triton_model.text.blocks)
    ids, embeds, _ = image_prompt(reference, sample_image(), [17, 40, 3, 99])
    assert len(ids) > CFG.prefix_len > 16  # the prefix spans more than one of the kernel's query blocks
    got, want = _run(triton_model, ids, embeds), _run(reference, ids, embeds)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_unknown_backend_is_refused():
    model = _model("reference")
    with pytest.raises(ValueError, match="kernel backend"):
        model.set_kernel_backend("cuda")
    assert model.backend == "reference"
