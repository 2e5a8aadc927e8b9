"""Wire model, device, KV cache, runner, planner and loop together from an EngineConfig."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.models.build import DTYPES, build_model
from slipstream.models.llama import KVCache
from slipstream.params import EngineConfig
from slipstream.runtime.device import make_device
from slipstream.runtime.model_runner import ModelRunner
from slipstream.scheduler.engine_loop import EngineLoop
from slipstream.scheduler.page_pool import PagePool
from slipstream.scheduler.planner import Planner

# Rows below this count take a different (batch-size dependent) CPU matmul path; padding to it
# keeps each row's result independent of what else is in the step.
CPU_INVARIANT_ROWS = 16


@dataclass
class EngineParts:
    device: object
    runner: ModelRunner
    pool: PagePool
    loop: EngineLoop
    tokenizer: object
    model_config: object
    max_model_len: int

    def close(self) -> None:
        self.device.close()


def assemble(config: EngineConfig, trace: bool = False) -> EngineParts:
    device = make_device(config.device)
    model, tokenizer, mcfg = build_model(config.model, config.dtype, device.torch_device, config.seed)
    max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    num_pages = -(-config.kv_cache_tokens // config.page_size) + 1  # + the scratch page
    kv = KVCache(mcfg, num_pages, config.page_size, DTYPES[config.dtype], device.torch_device)
    invariant = config.batch_invariant and device.kind == "cpu"
    min_rows = CPU_INVARIANT_ROWS if invariant else 1
    if invariant:
        model.set_attention_dtype(torch.float64)
    runner = ModelRunner(model, kv, device, max_rows=config.max_batch_size + 1, min_rows=min_rows)
    pool = PagePool(num_pages)
    planner = Planner(pool, config.page_size, config.max_batch_size, config.max_num_batched_tokens)
    loop = EngineLoop(runner, planner, config.pipeline_depth, config.page_size, min_rows, trace=trace)
    return EngineParts(device, runner, pool, loop, tokenizer, mcfg, max_model_len)
