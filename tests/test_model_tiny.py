"""The paged, flat-batch decoder equals transformers' LlamaForCausalLM on identical weights, both with
torch's dense linear layers and with the CPU fast path (oneDNN-packed projections, cpu_linear.py)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses

import pytest
import torch

from slipstream.models.config import tiny_config
from slipstream.models.kernels.cpu_linear import PackedLinear, onednn_available, pack_weights
from hf_oracle import random_hf_llama
from slipstream.models.base import KVCache
from slipstream.models.llama.model import LlamaForCausalLM
from host_batch import Chunk, host_batch

PAGE = 4


def run(model, kv, works, row_multiple=1):
    batch, n = host_batch(works, PAGE, row_multiple)
    return model(batch, kv)[:n]


def build(cfg, weights, layout):
    if layout == "dense":
        return LlamaForCausalLM.from_weights(cfg, weights, torch.float32, "cpu")
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    rest = dict(weights)
    model = LlamaForCausalLM.from_packed(cfg, rest, pack_weights(cfg, rest))
    assert isinstance(model.model.layers[0].mlp.up_proj, PackedLinear)
    return model


@pytest.fixture(scope="module", params=["dense", "packed"])
def pair(request):
    cfg = tiny_config()
    hf, weights = random_hf_llama(cfg, seed=0)
    return cfg, hf, build(cfg, weights, request.param)


@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_untied_lm_head_and_batched_decode_of_unequal_contexts(layout):
    """Three sequences decode in one step (one batched attention call over padded keys) with
    contexts 5, 11 and 2; each row equals transformers on its own sequence."""
    cfg = dataclasses.replace(tiny_config(), tie_word_embeddings=False)
    hf, weights = random_hf_llama(cfg, seed=3)
    ours = build(cfg, weights, layout)
    if layout == "packed":
        assert isinstance(ours.lm_head, PackedLinear)
    kv = KVCache(cfg, num_pages=16, page_size=PAGE, dtype=torch.float32, device="cpu")
    kv.k.fill_(float("nan"))  # the pool is uninitialised: attention must never read an unwritten slot
    kv.v.fill_(float("nan"))
    seqs = {1: ([7, 8, 9, 10, 11], [4, 9]), 2: (list(range(20, 31)), [1, 12, 6]), 3: ([40, 41], [3])}
    firsts = run(ours, kv, [Chunk(tokens=t, start_pos=0, pages=p) for t, p in seqs.values()])
    nexts = [int(x.argmax()) for x in firsts]
    out = run(ours, kv, [Chunk(tokens=[n], start_pos=len(t), pages=p)
                         for (t, p), n in zip(seqs.values(), nexts)])
    for row, ((t, _), n) in enumerate(zip(seqs.values(), nexts)):
        torch.testing.assert_close(out[row], hf_logits(hf, t + [n])[-1], atol=1e-4, rtol=0)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_match(pair):
    cfg, hf, ours = pair
    kv = KVCache(cfg, num_pages=16, page_size=PAGE, dtype=torch.float32, device="cpu")
    ids = list(range(3, 30))
    got = run(ours, kv, [Chunk(tokens=ids, start_pos=0, pages=[5, 2, 9, 1, 7, 3, 11], sample=True)])
    want = hf_logits(hf, ids)[-1]
    assert (got[0] - want).abs().max().item() < 1e-4


def test_mixed_batch_chunks_and_decodes_noncontiguous_pages(pair):
    """Step 1 prefills A's first chunk and all of B; step 2 mixes A's second chunk with B decodes."""
    cfg, hf, ours = pair
    kv = KVCache(cfg, num_pages=32, page_size=PAGE, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(1)
    a = torch.randint(3, cfg.vocab_size, (23,), generator=g).tolist()
    b = torch.randint(3, cfg.vocab_size, (9,), generator=g).tolist()
    c = torch.randint(3, cfg.vocab_size, (5,), generator=g).tolist()
    pages_a, pages_b, pages_c = [30, 4, 17, 8, 22, 13], [6, 25, 1, 19], [12, 27, 3]
    out1 = run(ours, kv, [
        Chunk(tokens=a[:10], start_pos=0, pages=pages_a, sample=False),
        Chunk(tokens=b, start_pos=0, pages=pages_b, sample=True),
        Chunk(tokens=c, start_pos=0, pages=pages_c, sample=True),
    ])
    torch.testing.assert_close(out1[0], hf_logits(hf, b)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(out1[1], hf_logits(hf, c)[-1], atol=1e-4, rtol=0)
    b_next, c_next = int(out1[0].argmax()), int(out1[1].argmax())
    out2 = run(ours, kv, [
        Chunk(tokens=[b_next], start_pos=len(b), pages=pages_b, sample=True),
        Chunk(tokens=a[10:], start_pos=10, pages=pages_a, sample=True),
        Chunk(tokens=[c_next], start_pos=len(c), pages=pages_c, sample=True),
    ], row_multiple=16)
    torch.testing.assert_close(out2[0], hf_logits(hf, b + [b_next])[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(out2[1], hf_logits(hf, a)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(out2[2], hf_logits(hf, c + [c_next])[-1], atol=1e-4, rtol=0)


def test_greedy_decode_matches_generate(pair):
    cfg, hf, ours = pair
    kv = KVCache(cfg, num_pages=32, page_size=PAGE, dtype=torch.float32, device="cpu")
    prompt = [5, 77, 300, 12, 9, 41]
    pages = [9, 3, 14, 1, 20, 7, 11, 2]
    ids = list(prompt)
    logits = run(ours, kv, [Chunk(tokens=ids, start_pos=0, pages=pages, sample=True)])
    for _ in range(24):
        ids.append(int(logits[0].argmax()))
        logits = run(ours, kv, [Chunk(tokens=[ids[-1]], start_pos=len(ids) - 1, pages=pages, sample=True)])
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0].tolist()
    assert ids == want


def test_padding_rows_do_not_change_results(pair):
    cfg, _, ours = pair
    kv = KVCache(cfg, num_pages=16, page_size=PAGE, dtype=torch.float32, device="cpu")
    work = [Chunk(tokens=[4, 5, 6, 7, 8], start_pos=0, pages=[3, 6], sample=True)]
    torch.testing.assert_close(run(ours, kv, work, row_multiple=1), run(ours, kv, work, row_multiple=16), atol=1e-5, rtol=0)
