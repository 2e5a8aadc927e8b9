"""The typed sampling path: a chunk's SamplingRow, staged and written to the row tables, comes back
as the SamplingArgs of a group with exactly the fields its rows need; and the runner's step types
stay private to it."""
import ast
import pathlib

import numpy as np
import torch

from slipstream.runtime.batch import SamplingRow, SeqWork
from slipstream.runtime.sampling.sampling_args import NUM_FLOATS, NUM_INTS, SamplingTables, stage_params

ROOT = pathlib.Path(__file__).resolve().parent.parent / "slipstream"


def _tables(*chunks: SeqWork) -> SamplingTables:
    t = SamplingTables(8, torch.device("cpu"))
    ints, floats = np.zeros((NUM_INTS, len(chunks)), np.int64), np.zeros((NUM_FLOATS, len(chunks)), np.float32)
    stage_params(chunks, ints, floats)
    t.write(torch.tensor([w.row for w in chunks]), torch.from_numpy(ints), torch.from_numpy(floats))
    t.mirror(chunks)
    return t


def _chunk(row: int, output_index: int = 0, **sampling) -> SeqWork:
    return SeqWork(row=row, tokens=[5], start_pos=0, sample=True, output_index=output_index,
                   sampling=SamplingRow(**sampling))


def test_every_field_round_trips_from_the_chunk_to_the_group_args():
    t = _tables(_chunk(3, 7, temperature=0.5, top_k=4, top_p=0.9, seed=11, presence_penalty=0.25,
                       frequency_penalty=-0.5, repetition_penalty=1.5, min_p=0.125, min_tokens=2, top_logprobs=3,
                       logprobs=True),
                _chunk(5, 1))
    host = np.array([3, 5])
    needs = t.needs(host)
    assert (needs.random, needs.filtered, needs.penalties, needs.min_tokens, needs.min_p, needs.logprobs,
            needs.top_logprobs) == (True, True, True, True, True, True, 3)
    a = t.gather(torch.tensor([3, 5]), needs)
    assert a.output_index.tolist() == [7, 1]
    assert a.draw is not None and a.draw.temperature.tolist() == [0.5, 0.0] and a.draw.seed.tolist() == [11, 0]
    assert a.draw.filter is not None and a.draw.filter.top_k.tolist() == [4, 0]
    assert a.draw.filter.top_p.tolist() == [0.8999999761581421, 1.0]
    assert a.penalties is not None and a.penalties.presence.tolist() == [0.25, 0.0]
    assert a.penalties.frequency.tolist() == [-0.5, 0.0] and a.penalties.repetition.tolist() == [1.5, 1.0]
    assert a.min_tokens is not None and a.min_tokens.tolist() == [2, 0]
    assert a.min_p is not None and a.min_p.tolist() == [0.125, 0.0]
    t.advance(torch.tensor([3, 5]), a)
    assert t.output_index[[3, 5]].tolist() == [8, 2]


def test_a_plain_greedy_group_gathers_only_its_output_index():
    t = _tables(_chunk(2, 4), _chunk(6, 0, temperature=1.0))
    needs = t.needs(np.array([2]))
    assert needs.plain_greedy and not t.needs(np.array([2, 6])).plain_greedy
    a = t.gather(torch.tensor([2]), needs)
    assert a.output_index.tolist() == [4]
    assert (a.draw, a.penalties, a.min_tokens, a.min_p) == (None, None, None, None)
    assert not a.needs_history


def test_the_runners_step_types_are_private_to_it():
    """The scheduler imports batch.py and runner_api.py only; the API (which assembles the runner)
    never the runner's staging, row tables or sampling modules."""
    private = {f"slipstream.runtime.{m}" for m in ("staging", "static_step", "row_tables", "sampling_args",
                                                  "sampling_launch", "sampler", "logits_process")}
    for layer, ok in (("scheduler", lambda m: m in {"slipstream.runtime.batch", "slipstream.runtime.runner_api"}),
                      ("api", lambda m: m not in private)):
        for path in (ROOT / layer).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slipstream.runtime"):
                    assert ok(node.module), f"{layer}/{path.name} imports {node.module} (private to the runner)"
