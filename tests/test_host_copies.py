"""The CUDA path's host copies and table writes, checked on the CPU device (issue 25, item 3):
  - device->host copies land in contiguous host views (a strided view makes torch copy through a
    pageable temporary: the non-blocking copy then blocks the host);
  - admission of a penalised / min_tokens request stages its history in one array (pinned on CUDA)
    instead of building device tensors from Python lists (a synchronous copy);
  - the history tables are allocated on the compute stream, where the work that uses them runs.
"""
import asyncio
import threading

import numpy as np
import pytest
import torch

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.errors import PipelineInvariantError
from slipstream.runtime.devices import host_copy
from slipstream.runtime.step import row_tables, step_slot
from slipstream.runtime.step.row_tables import HistoryTables

CFG = dict(model="tiny-random", max_batch_size=8, max_num_batched_tokens=64, kv_cache_tokens=4096, page_size=8)
PROMPT = [5, 9, 11, 40, 40, 7, 300, 12]


async def _complete(params_list, **cfg):
    async with Engine(EngineConfig(**{**CFG, **cfg})) as engine:
        return await asyncio.gather(*(engine.complete(PROMPT, p) for p in params_list))


def test_copy_helpers_refuse_a_strided_host_view():
    host = torch.zeros(4, 20)
    dev = torch.ones(4, 20)
    with pytest.raises(PipelineInvariantError, match="not contiguous"):
        host_copy.copy_to_host(host[:2, :3], dev[:2, :3])
    with pytest.raises(PipelineInvariantError, match="not contiguous"):
        host_copy.copy_to_device(dev[:2, :3], host[:2, :3])
    host_copy.copy_to_host(host[:2], dev[:2])  # whole rows: one range
    assert host[:2].eq(1).all() and host[2:].eq(0).all()
    assert torch.equal(host_copy.upload_array(np.arange(5), torch.device("cpu")), torch.arange(5))


def test_top_logprobs_of_two_rows_copy_whole_contiguous_rows(monkeypatch):
    """n = 2 rows asking for top_logprobs = 3 (< 20): every device->host copy goes through the
    helper, and its host side is contiguous. (Mutant: copying [:n, :top] again fails the step.)"""
    seen = []
    real = step_slot.copy_to_host

    def spy(dst, src):
        seen.append((tuple(dst.shape), dst.is_contiguous()))
        real(dst, src)

    monkeypatch.setattr(step_slot, "copy_to_host", spy)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, top_logprobs=3)
    outs = asyncio.run(_complete([params, params]))
    for out in outs:
        assert len(out.top_logprobs) == 6 and all(len(a) == 3 for a in out.top_logprobs)
        assert [next(iter(a)) for a in out.top_logprobs] == out.token_ids  # greedy: the top alternative
    assert all(contiguous for _, contiguous in seen)
    assert (2, 20) in [shape for shape, _ in seen]  # the top values/ids of a two-row step, whole rows


def test_admission_builds_no_device_tensor_from_python_lists(monkeypatch):
    """HistoryTables.admit stages its rows, prompts, outputs and stop ids as one array through
    host_copy.upload_array; torch.tensor(list, device=...) (a blocking copy on CUDA) is never called."""
    real_tensor = torch.tensor

    def guarded(data, *args, **kw):
        if kw.get("device") is not None:
            raise AssertionError(f"torch.tensor(..., device={kw['device']!r}) during admission")
        return real_tensor(data, *args, **kw)

    uploads = []
    real_upload = row_tables.upload_array
    monkeypatch.setattr(row_tables, "upload_array", lambda a, d: uploads.append(a.copy()) or real_upload(a, d))
    tables = HistoryTables(8, 50, "cpu")
    monkeypatch.setattr(torch, "tensor", guarded)
    tables.admit([3, 5], [[1, 1, 2], [4]], [[7], []], [[0], [0, 9]])
    monkeypatch.setattr(torch, "tensor", real_tensor)
    assert [a.tolist() for a in uploads] == [[3, 5, 1, 1, 2, 4, 3, 3, 3, 5, 7, 3, 0, 0, 9, 3, 5, 5]]
    assert tables.prompt_mask[3].nonzero().flatten().tolist() == [1, 2]
    assert tables.output_counts[3, 7].item() == 1 and tables.output_counts[5].sum().item() == 0
    assert tables.stop_mask[5].nonzero().flatten().tolist() == [0, 9]


def test_penalised_requests_are_admitted_through_the_staging_path(monkeypatch):
    uploads = []
    real_upload = row_tables.upload_array
    monkeypatch.setattr(row_tables, "upload_array", lambda a, d: uploads.append(len(a)) or real_upload(a, d))
    outs = asyncio.run(_complete([SamplingParams(max_tokens=4, temperature=0.0, presence_penalty=1.0),
                                  SamplingParams(max_tokens=4, temperature=0.0, min_tokens=2)]))
    assert all(len(o.token_ids) >= 2 for o in outs)
    assert uploads  # (one per step that admits)


def test_history_tables_are_allocated_on_the_compute_stream(monkeypatch):
    """Created on the loop thread (at launch), their zero-fill would run on CUDA's legacy default
    stream, which the engine's non-blocking compute stream does not wait for. The CPU device runs
    compute-stream work on its own thread: the allocation must happen there."""
    where = []
    real_init = HistoryTables.__init__

    def spy(self, *args, **kw):
        where.append(threading.current_thread().name)
        real_init(self, *args, **kw)

    monkeypatch.setattr(HistoryTables, "__init__", spy)
    outs = asyncio.run(_complete([SamplingParams(max_tokens=4, temperature=0.0, frequency_penalty=0.5)] * 2))
    assert all(len(o.token_ids) == 4 for o in outs)
    assert where == ["slipstream-compute"]


def test_a_preempted_penalised_request_is_readmitted_with_its_output_so_far():
    """The recompute after a preemption re-admits the row from the prompt and the output so far (the
    staged array carries both): penalised outputs equal the run without preemption. (Mutant: the
    staged outputs dropped at admission.)"""
    import msgspec

    from test_engine_tiny import mixed_requests

    reqs = [(p, msgspec.structs.replace(sp, max_tokens=20, temperature=0.0, stop=None, stop_token_ids=None,
                                        frequency_penalty=0.7 if i % 2 == 0 else 0.0))
            for i, (p, sp, _) in enumerate(mixed_requests(12, seed=3))]

    async def run(**kw):
        async with Engine(EngineConfig(**{**CFG, "batch_invariant": True, **kw})) as engine:
            outs = await asyncio.gather(*(engine.complete(p, sp) for p, sp in reqs))
            return [o.token_ids for o in outs], engine._parts.loop.planner.num_preemptions

    want, _ = asyncio.run(run())
    got, preemptions = asyncio.run(run(kv_cache_tokens=160))
    assert preemptions > 0 and got == want


def test_pixels_for_the_encoder_must_be_contiguous_on_the_cpu_as_on_a_gpu():
    """Idefics3's tiles came out of preprocessing as a CHW view of HWC memory: on the H200 the
    encoder launch refused them, on the CPU nothing looked (2026-11-27). Now both refuse them."""
    strided = torch.zeros(2, 8, 8, 3).permute(0, 3, 1, 2)
    with pytest.raises(PipelineInvariantError, match="not contiguous"):
        host_copy.stage_pixels(strided, torch.device("cpu"))
    dense = strided.contiguous()
    assert host_copy.stage_pixels(dense, torch.device("cpu")) is dense


def test_idefics3_preprocessing_gives_contiguous_pixels():
    from image_util import picture
    from slipstream.models.idefics3.config import ProcessingConfig
    from slipstream.models.idefics3.processor import Idefics3Processing

    (image,) = Idefics3Processing(ProcessingConfig(longest_edge=128, tile=64), 4).preprocess([picture(100, 150, 0)])
    assert image.pixel_values.shape[0] > 1 and image.pixel_values.is_contiguous()


def test_pictures_are_pinned_on_the_preprocessing_thread_never_on_the_loop(monkeypatch):
    """A CUDA engine's pixels (up to ~53 MB per Idefics3 picture) are put in pinned memory where the
    picture is cut, on a worker thread; the encoder launch in the tick then only enqueues their copy
    (host_copy.stage_pixels, which refuses pixels that are not pinned)."""
    from types import SimpleNamespace

    from image_util import picture
    from slipstream.api import image_prompt

    pinned = []
    monkeypatch.setattr(image_prompt, "pin_pixels", lambda p: pinned.append(threading.current_thread()) or p)
    processing = SimpleNamespace(
        preprocess=lambda images: [SimpleNamespace(pixel_values=torch.zeros(1), num_image_tokens=2) for _ in images],
        expand=lambda text, processed: text.replace("<image>", "##"))
    tokenizer = SimpleNamespace(encode=lambda text: [7 if c == "#" else 1 for c in text])

    async def submit(pin):
        loop_thread = threading.current_thread()
        ids, spans = await image_prompt.prepare_images_off_loop("<image>hi<image>", [picture(8, 8, 0)] * 2,
                                                                ["a", "b"], processing, tokenizer, 7, None, pin=pin)
        return loop_thread, ids, spans

    loop_thread, ids, spans = asyncio.run(submit(False))
    assert pinned == [] and len(spans) == 2
    loop_thread, _, _ = asyncio.run(submit(True))
    assert len(pinned) == 2 and loop_thread not in pinned
