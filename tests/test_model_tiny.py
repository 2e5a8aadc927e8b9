"""The paged, flat-batch decoder equals transformers' LlamaForCausalLM on identical weights."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from slipstream.models.config import tiny_config
from slipstream.models.hf_oracle import random_hf_llama
from slipstream.models.llama import ForwardBatch, KVCache, LlamaForCausalLM
from slipstream.models.host_batch import Chunk, host_batch

PAGE = 4


def run(model, kv, works, row_multiple=1):
    batch, n = host_batch(works, PAGE, row_multiple)
    return model(batch, kv)[:n]


@pytest.fixture(scope="module")
def pair():
    cfg = tiny_config()
    hf, weights = random_hf_llama(cfg, seed=0)
    ours = LlamaForCausalLM.from_weights(cfg, weights, torch.float32, "cpu")
    return cfg, hf, ours


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
