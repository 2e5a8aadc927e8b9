"""Speculation's kernels on CUDA give what they give on the CPU: n-gram proposals, the token history
(duplicate writes land only in its sink column), replay acceptance and rejection sampling."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.speculation.ngram_drafter import NgramDrafter
from slipstream.runtime.sampling.sampling_args import Draw, SamplingArgs, TopKTopP
from slipstream.speculation.verify import rejection_accept, replay_accept, spec_layout, target_tokens
from slipstream.speculation.history import TokenHistory

pytestmark = pytest.mark.cuda
N, K, V = 64, 4, 1000


def on(device: str):
    """Every input of a group of N rows, the same on any device."""
    g = torch.Generator().manual_seed(5)
    k = torch.randint(0, K + 1, (N,), generator=g).numpy()
    p = int((k + 1).sum())
    logits = torch.randn(p, V, generator=g) * 2
    drafts = torch.randint(0, V, (N, K), generator=g)
    drafts[:, 0] = logits[torch.from_numpy(np.concatenate([[0], np.cumsum(k + 1)[:-1]]))].argmax(-1)  # some right
    q = torch.rand(N, K, V, generator=g)
    q /= q.sum(-1, keepdim=True)
    temperature = torch.full((N,), 0.9)
    temperature[::4] = 0.0
    args = SamplingArgs(torch.arange(N) % 11, draw=Draw(temperature, torch.arange(N) * 3,
                                                        TopKTopP(torch.full((N,), 50), torch.full((N,), 0.9))))
    d = args.draw
    moved = SamplingArgs(args.output_index.to(device), draw=Draw(d.temperature.to(device), d.seed.to(device),
                                                                 TopKTopP(*(t.to(device) for t in d.filter))))
    return (logits.to(device), drafts.to(device), q.to(device), moved, spec_layout(k, device, max_drafts=K))


def test_verification_agrees_with_the_cpu():
    cpu, gpu = on("cpu"), on("cuda")
    greedy = [SamplingArgs(x[3].output_index) for x in (cpu, gpu)]
    a, b = (replay_accept(target_tokens(x[0], args, x[1], x[4]), x[1], x[4]) for x, args in zip((cpu, gpu), greedy))
    assert torch.equal(a.tokens, b.tokens.cpu())
    for rule in ("replay", "point", "rejection"):
        got = []
        for logits, drafts, q, args, lay in (cpu, gpu):
            if rule == "replay":
                v = replay_accept(target_tokens(logits, args, drafts, lay), drafts, lay)
            else:
                v = rejection_accept(logits, args, drafts, q if rule == "rejection" else None, lay)
            got.append(v.tokens.cpu())
        same = (got[0] == got[1]).all(1).float().mean().item()
        assert same >= 0.95, (rule, same)  # (float rounding may flip a near tie)


def test_ngram_and_history_agree_with_the_cpu():
    rng = np.random.RandomState(3)
    seqs = [rng.randint(0, 5, rng.randint(2, 300)).tolist() for _ in range(N)]
    emitted = torch.from_numpy(rng.randint(0, 5, (N, K + 1)))
    out = []
    for device in ("cpu", "cuda"):
        h = TokenHistory(N + 1, 320, device)
        rows = torch.arange(1, N + 1, device=device)
        flat = torch.tensor([t for s in seqs for t in s], device=device)
        owner = torch.tensor([i + 1 for i, s in enumerate(seqs) for _ in s], device=device)
        pos = torch.tensor([j for s in seqs for j in range(len(s))], device=device)
        h.write_chunks(owner, pos, flat, rows, torch.tensor([len(s) for s in seqs], device=device))
        h.append(rows, emitted.to(device), torch.full((N,), K + 1, device=device))
        p = NgramDrafter(h, max_drafts=6, window=256).propose(rows)
        out.append((h.tokens.cpu(), h.length.cpu(), p.tokens.cpu(), p.matched.cpu()))
    cpu, gpu = out
    assert torch.equal(cpu[1], gpu[1]) and torch.equal(cpu[0][:, :320], gpu[0][:, :320])
    assert torch.equal(cpu[3], gpu[3]) and torch.equal(cpu[2], gpu[2])
