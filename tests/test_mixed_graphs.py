"""Graphs of mixed and prefill steps, without a GPU: the fixed-shape layout of a token bucket
(slipstream/runtime/static_step.py) run through ModelRunner with the Triton kernels interpreted.

The stand-in "graph" is captured once per (slot, token bucket): it keeps the bucket's device views
and replays by running the forward on them again. That is exactly what a CUDA graph relies on:
nothing of a step may be baked into the capture except its bucket, so refilling the arena with
another step of the same bucket must give that step's answer. The cuda-marked tests capture real
graphs.
"""
import numpy as np
import pytest
import structlog
import torch

pytest.importorskip("triton")

from slipstream.models.build import build_model  # noqa: E402
from slipstream.models.llama import KVCache  # noqa: E402
from slipstream.runtime.batch import SamplingRow, SeqWork, pack_step  # noqa: E402
from slipstream.runtime.buckets import token_buckets  # noqa: E402
from slipstream.runtime.cpu_device import CPUDevice  # noqa: E402
from slipstream.runtime.graphs import MIXED, GraphCache  # noqa: E402
from slipstream.runtime.model_runner import ModelRunner  # noqa: E402
from slipstream.runtime.static_step import static_tensors  # noqa: E402

PAGE, PAGES_PER_ROW = 8, 6
PROMPTS = {r: [(7 * r + 3 * i) % 500 + 3 for i in range(n)] for r, n in {1: 10, 2: 30, 3: 5, 4: 30, 5: 12, 6: 20}.items()}


def _chunk(row, lo, hi, sample):
    return SeqWork(row=row, tokens=PROMPTS[row][lo:hi], start_pos=lo, sample=sample, output_index=0,
                   sampling=SamplingRow(temperature=0.1 * row, top_k=row, seed=100 + row))


def _pages(*rows):
    return np.array([[r, i, 1 + PAGES_PER_ROW * (r - 1) + i] for r in rows for i in range(PAGES_PER_ROW)])


# (decode rows, chunks, new rows): slots alternate 0, 1, 0, ...; buckets (16, 32) below
STEPS = [
    ([], [_chunk(1, 0, 10, True), _chunk(2, 0, 20, False), _chunk(3, 0, 5, True)], (1, 2, 3)),  # 35 tokens: eager
    ([1, 3], [_chunk(2, 20, 30, True), _chunk(4, 0, 17, False)], (4,)),  # 29 -> (slot 1, 32)
    ([1, 2, 3], [_chunk(4, 17, 30, True), _chunk(5, 0, 8, False)], (5,)),  # 24 -> (slot 0, 32)
    ([1, 2, 3, 4], [_chunk(5, 8, 12, True)], ()),  # 8 -> (slot 1, 16)
    ([1, 2, 3, 4, 5], [], ()),  # decode only: eager (no decode graphs here)
    ([1, 2, 3, 4, 5], [_chunk(6, 0, 20, True)], (6,)),  # 25 -> (slot 1, 32) again, another step
]


class ReplayAgain:
    """A stand-in graph: the bucket's device views, fixed at capture; replay = run the forward again."""

    def __init__(self, runner, slot, tokens, log):
        self.runner, self.tokens, self.log, self.slot = runner, tokens, log, slot
        self.tensors = static_tensors(runner.arenas[slot], tokens)

    def replay(self):
        self.log.append((self.slot, self.tokens))
        return self.runner.forward_from(self.tensors)


def _runner(dev):
    model, _, cfg = build_model("tiny-random", "float32", torch.device("cpu"), seed=0)  # its own modules
    model.set_kernel_backend("triton")
    kv = KVCache(cfg, num_pages=1 + PAGES_PER_ROW * 6, page_size=PAGE, dtype=torch.float32, device=torch.device("cpu"))
    kv.k.zero_()
    kv.v.zero_()
    return ModelRunner(model, kv, dev, max_rows=8, max_tokens=64, max_pages=PAGES_PER_ROW)


def _run(runner, steps):
    """Logits and final hidden states (the lm_head's input) of each step's sampled rows."""
    logits, hidden = [], []
    runner.model.model.norm.register_forward_hook(lambda m, args, out: hidden.append(out))
    for i, (decode, chunks, new_rows) in enumerate(steps):
        packed = pack_step(np.array(decode, np.int64), chunks, _pages(*new_rows) if new_rows else None)
        slot = runner.slots[i % 2]
        runner.launch_forward(slot, i, packed)
        runner.device.compute.record().synchronize()
        n = packed.num_samples
        got = slot.logits[:n].clone()
        logits.append((got, hidden[-1][:n].clone()))
        runner.rows.token[torch.from_numpy(packed.sample_rows)] = got.argmax(-1)  # stands in for sampling
        slot.release()
    return logits


def _tables(runner):
    r = runner.rows
    return {"pos": r.pos, "pages": r.pages, "token": r.token, **r.ints, **r.floats}


def test_static_mixed_steps_equal_the_eager_steps_and_leave_the_same_row_tables():
    dev_e, dev_g = CPUDevice(), CPUDevice()
    try:
        eager, graphed = _runner(dev_e), _runner(dev_g)
        replays = []
        graphed.mixed_graphs = GraphCache(token_buckets(16, 32), 2, lambda s, t: ReplayAgain(graphed, s, t, replays),
                                          kind=MIXED)
        with structlog.testing.capture_logs() as logs:
            want = _run(eager, STEPS)
            got = _run(graphed, STEPS)
        assert replays == [(1, 32), (0, 32), (1, 16), (1, 32)]  # the last reuses step 2's capture
        assert graphed.mixed_graphs.eager_steps == 1
        assert [(e["event"], e.get("tokens")) for e in logs if e["event"] != "cuda_graph_captured_on_first_use"] \
            == [("mixed_step_above_graph_buckets", 35)]
        for i, ((w, wh), (g, gh)) in enumerate(zip(want, got)):
            assert torch.equal(wh, gh), f"step {i}: final hidden states of the sampled rows"
            # the lm_head multiplies N >= n rows: a CPU (or cuBLAS) kernel for another row count may
            # round differently, so logits are equal up to that (bitwise whenever the kernels match)
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
        te, tg = _tables(eager), _tables(graphed)
        for name in te:
            assert torch.equal(te[name], tg[name]), name
        used = slice(PAGE, None)  # every real page; the scratch page (0) took the padding's writes
        assert torch.equal(eager.kv.k[:, used], graphed.kv.k[:, used])
        assert torch.equal(eager.kv.v[:, used], graphed.kv.v[:, used])
        assert graphed.rows.pos[0] == 0 and (graphed.rows.pages[0] == 0).all()  # scratch row untouched
    finally:
        dev_e.close()
        dev_g.close()
