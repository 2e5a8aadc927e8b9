"""Wire model, device, KV cache, runner, planner and loop together from an EngineConfig."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch

from slipstream.api.output_processor import OutputProcessor
from slipstream.errors import InvalidRequestError
from slipstream.intmath import ceil_div
from slipstream.metrics import EngineMetrics
from slipstream.models import registry
from slipstream.models.base import DTYPES, KVCache, Model
from slipstream.models.loading.build import build_model, cpu_backend_available
from slipstream.params import EngineConfig
from slipstream.runtime.devices.cpu_invariance import row_multiple_for
from slipstream.runtime.devices.device import Device
from slipstream.runtime.devices.make import make_device
from slipstream.runtime.model_runner import ModelRunner
from slipstream.scheduler.engine_loop import EngineLoop
from slipstream.scheduler.page_pool import PagePool
from slipstream.scheduler.planner import Planner
from slipstream.trace import Tracer

log = structlog.get_logger(__name__)
CPU_KV_TOKENS = 32768


@dataclass
class EngineParts:
    device: Device
    runner: ModelRunner
    pool: PagePool
    loop: EngineLoop
    tokenizer: Any  # the model's (models/tokenizers/)
    model_config: Any  # ModelConfig's fields (Moondream's text section has the same names)
    max_model_len: int
    metrics: EngineMetrics | None = None
    tracer: Tracer | None = None  # only with EngineConfig(trace=True)
    encoder_row_bytes: int = 0  # bytes of one encoder output row (the encoder cache's stats)
    image_processing: Any = None  # the model's image preprocessing and prompt expansion (None: text only)
    outputs: OutputProcessor | None = None  # the loop's output sink (its text thread ends at close)

    def close(self) -> None:
        self.device.close()  # (synchronizes: no replay is pending)
        if self.runner.graphs is not None:  # freed now, never inside another engine's capture
            from slipstream.runtime.graphs.cuda_graphs import release_graphs

            release_graphs(self.runner)
        # what a caller may keep after close (engine.metrics' registry, engine.tracer) lets go of
        # the loop, and through it the runner; the output stage's thread ends
        if self.metrics is not None:
            self.metrics.detach()
        if self.tracer is not None:
            self.tracer.detach()
        if self.outputs is not None:
            self.outputs.close()


def kv_pages(config: EngineConfig, model: Model, mcfg, device, max_model_len: int, processing=None) -> int:
    """Pages in the pool, the scratch page included: from kv_cache_tokens, or from free GPU memory.
    `processing`: the model's image processing (None: text only)."""
    if config.kv_cache_tokens is not None or device.kind != "cuda":
        return ceil_div(config.kv_cache_tokens or CPU_KV_TOKENS, config.page_size) + 1
    from slipstream.runtime.devices import memory

    dtype = DTYPES[config.dtype]
    image = processing.largest_input() if processing is not None else None  # the vision tower's peak too
    free = memory.profile_free_memory(model, mcfg, device, config.max_num_batched_tokens, config.page_size, dtype,
                                      image=image)
    # graphs, sampling, tables and encoder outputs come after the KV pool
    reserve = memory.engine_reserve(config, mcfg, dtype, carry=model.carry_heads is not None,
                                    images=processing is not None)
    log.info("memory_reserved_before_kv", **reserve.gib())
    return memory.kv_pages_for_memory(free, config.gpu_memory_utilization,
                                      memory.kv_bytes_per_page(mcfg, config.page_size, dtype),
                                      min_pages=ceil_div(max_model_len, config.page_size) + 1,
                                      reserved_bytes=reserve.total)


def lora_bank(config: EngineConfig, model: Model, mcfg, device):
    """The device bank of max_loras LoRA slots (models/lora_bank.py) where the triton backend serves
    adapters: CUDA, a family that computes LoRA, and lora_adapters given (possibly empty); else None."""
    if device.kind != "cuda" or config.lora_adapters is None or not registry.for_spec(config.model).lora:
        return None
    from slipstream.models.lora_bank import LoraBank

    bank = LoraBank(mcfg, config.max_loras, config.max_lora_rank, DTYPES[config.dtype], device.torch_device)
    log.info("lora_bank_allocated", slots=config.max_loras, rank=config.max_lora_rank,
             gib=round(bank.nbytes / 1024**3, 3))
    return bank


def assemble(config: EngineConfig) -> EngineParts:
    invariant = config.batch_invariant and config.device == "cpu"
    # Invariance's row padding is probed at torch's thread count: its forward keeps that count.
    device = make_device(config.device, config.event_wait,
                         cpu_forward_threads=torch.get_num_threads() if invariant else None)
    try:
        return _assemble(config, device, invariant)
    except BaseException:  # (a model not found, a pool too small): the device's stream threads stop
        device.close()
        raise


def _assemble(config: EngineConfig, device, invariant: bool) -> EngineParts:
    # Invariance is calibrated against torch's default kernels, so it keeps the dense model.
    # (build_model is the seam tools/bench/bench_host.py and tests replace)
    model, tokenizer, mcfg = build_model(config.model, config.dtype, device.torch_device, config.seed,
                                         pack=not invariant, weights=config.weights, invariant=invariant)
    cpu_kernels = device.kind != "cuda" and not invariant and config.dtype == "float32" and cpu_backend_available(model)
    activations = resolve_activations(config.activations, cpu_kernels)
    if device.kind == "cuda":
        model.set_kernel_backend("triton")
    elif cpu_kernels:
        model.set_kernel_backend("cpu")  # compiled kernels (models/llama/forward_cpu.py); invariance keeps the reference
        model.set_activations(activations)
        calibrate_forward_threads(device, model)
    log.info("activations_chosen", asked=config.activations, used=activations)
    max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    # what turns a request's images into prompt rows (None: text only), the model's family's
    processing = registry.for_spec(config.model).image_processing(model)
    bank = lora_bank(config, model, mcfg, device)  # (before the KV pool: its memory is taken first)
    num_pages = kv_pages(config, model, mcfg, device, max_model_len, processing)
    kv = KVCache(mcfg, num_pages, config.page_size, DTYPES[config.dtype], device.torch_device)
    log.info("kv_cache_allocated", pages=num_pages, page_size=config.page_size, gib=round(kv.bytes() / 1024**3, 2))
    row_multiple = 1
    if invariant:  # the probe (seconds at start) runs only here
        row_multiple = row_multiple_for(mcfg)
        model.set_attention_dtype(torch.float64)
    max_pages = ceil_div(max_model_len, config.page_size)
    if config.speculative is not None:  # a speculating graph's masked positions read up to K past a row's
        max_pages += ceil_div(config.speculative.num_drafts + 1, config.page_size)  # end: scratch-page columns
    runner = ModelRunner(model, kv, device, max_rows=config.max_batch_size + 1,
                         max_tokens=config.max_num_batched_tokens,
                         max_pages=max_pages, row_multiple=row_multiple,
                         num_slots=config.pipeline_depth)  # depth 1 never uses a second slot (nor its graphs)
    runner.forward.lora_bank = bank
    pool = PagePool(num_pages)
    planner = Planner(pool, config.page_size, config.max_batch_size, config.max_num_batched_tokens,
                      prefix_caching=config.prefix_caching, encoder_cache_tokens=config.encoder_cache_tokens,
                      max_encoder_tokens=config.max_encoder_tokens_per_step, kv_window=mcfg.kv_window())
    if config.speculative is not None:
        install_speculation(config, runner, planner, ceil_div(max_model_len, config.page_size) * config.page_size,
                            mcfg, tokenizer, device, activations)
    if device.kind == "cuda" and config.cuda_graphs:
        from slipstream.runtime.graphs.cuda_graphs import install_graphs

        install_graphs(runner, device, config)  # (after speculation: plain graphs write its history)
    outputs = OutputProcessor(text_thread=config.output_stage == "thread")
    loop = EngineLoop(runner, planner, outputs, config.pipeline_depth, config.page_size, row_multiple,
                      vocab_width=mcfg.vocab_size, eos_ids=tuple(tokenizer.eos_token_ids),
                      step_timeout_s=config.step_timeout_s)
    tracer = Tracer().attach(loop, runner, device) if config.trace else None
    row_bytes = mcfg.hidden_size * torch.empty(0, dtype=DTYPES[config.dtype]).element_size()
    metrics = EngineMetrics(model=config.model).attach(
        loop, pool, tracer, encoder_row_bytes=row_bytes if processing is not None else None)
    return EngineParts(device, runner, pool, loop, tokenizer, mcfg, max_model_len, metrics, tracer, row_bytes,
                       processing, outputs)


def install_speculation(config: EngineConfig, runner: ModelRunner, planner: Planner, max_len: int, target_config,
                        tokenizer, device, activations: str = "float") -> None:
    """Speculative decoding (docs/speculative.md): the runner's drafting and verifying, the planner's drafts."""
    from slipstream.speculation.runner import SpecRunner
    from slipstream.speculation.policy import FORWARD_MS_BY_ACTIVATIONS, Speculation

    spec = config.speculative
    assert spec is not None
    if spec.method == "draft":
        assert spec.draft_model is not None  # (SpeculativeConfig checks it)
        options: dict = dict(model=draft_model(config, spec.draft_model, target_config, tokenizer, device),
                             context=spec.draft_context)
    else:
        options = dict(min_n=spec.min_n, max_n=spec.max_n, window=spec.window)
    runner.spec = SpecRunner(runner, spec.method, spec.num_drafts, max_len, **options)
    # every device times its steps (CUDA by events, the CPU by its compute thread's CPU time): the cost
    # table's shape is one machine's, and where a multi-position forward costs more than it says (an
    # AVX2 CPU: docs/results/spec-2026-12-02/NOTES.md) drafts must stop paying
    runner.spec_timed = True
    planner.speculation = Speculation(spec.num_drafts, spec.adaptive, FORWARD_MS_BY_ACTIVATIONS[activations], timed=True)
    if spec.adaptive and runner.spec.can_shadow:  # rows that do not draft are probed on the host
        planner.speculation.shadow, planner.speculation.shadow_window = runner.spec.shadow, spec.window


DRAFT_PROBE = "The draft model must split text as the target does: 12345, naïve café, 日本語 🚀."


def check_draft_model(target_config, target_tokenizer, draft_config, draft_tokenizer) -> None:
    """Drafts are the draft model's token ids fed to the target: refuse a draft model whose vocabulary
    or tokenizer differs (InvalidRequestError naming speculative.draft_model)."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise InvalidRequestError(f"speculative.draft_model has a vocabulary of {draft_config.vocab_size} tokens, "
                                  f"the model {target_config.vocab_size}", param="speculative.draft_model")
    if draft_tokenizer.encode(DRAFT_PROBE) != target_tokenizer.encode(DRAFT_PROBE):
        raise InvalidRequestError("speculative.draft_model's tokenizer splits text differently from the model's",
                                  param="speculative.draft_model")


def draft_model(config: EngineConfig, name: str, target_config, tokenizer, device):
    """The draft model of SpeculativeConfig(method="draft"), checked against the target; on the CPU
    kernels where it can run on them (drafts need no invariance: verification decides)."""
    if device.kind != "cpu":
        raise InvalidRequestError("speculative method 'draft' runs on the CPU only (it reads the history on the host)",
                                  param="speculative.method")
    model, draft_tokenizer, draft_config = build_model(name, "float32", device.torch_device, config.seed, pack=True,
                                                       weights=config.weights)
    check_draft_model(target_config, tokenizer, draft_config, draft_tokenizer)
    if cpu_backend_available(model):
        model.set_kernel_backend("cpu")
        model.set_activations(resolve_activations(config.activations, True))
    return model


def resolve_activations(asked: str, cpu_kernels: bool) -> str:
    """EngineConfig.activations as the model runs it: "auto" is int16 on the CPU's compiled kernels
    where the CPU has AVX512-VNNI (greedy output still transformers' on the oracle prompts, and a
    verification forward ~16% cheaper: docs/models.md), float elsewhere (the plain-C int16 path was
    not measured against float). Rounding asked for where nothing rounds is refused, not ignored."""
    if asked == "auto":
        return "int16" if cpu_kernels and int16_has_vnni() else "float"
    if asked != "float" and not cpu_kernels:
        raise InvalidRequestError(f"activations={asked!r} needs the CPU's compiled kernels (device cpu, "
                                  "dtype float32, no batch invariance)", param="activations")
    return asked


def int16_has_vnni() -> bool:
    """Whether the compiled int16 products use AVX512-VNNI here (quant_matmul_q16_cpu.c)."""
    from slipstream.models.kernels.cpu_kernels import native_kernels

    lib = native_kernels()
    return lib is not None and lib.sq_q16_vnni() == 1


def calibrate_forward_threads(device, model) -> None:
    """The compute stream's thread count, as measured on this machine (runtime/devices/cpu_threads.py). A
    failed measurement only logs: the device keeps its default."""
    from slipstream.runtime.devices.cpu_threads import forward_threads

    ceiling, chosen = torch.get_num_threads(), []

    def measure() -> None:
        try:
            chosen.append(forward_threads(model, ceiling))
        except Exception as exc:  # noqa: BLE001 - a measurement must not stop the engine
            torch.set_num_threads(device.forward_threads)
            log.warning("cpu_forward_threads_kept", threads=device.forward_threads,
                        error=f"{type(exc).__name__}: {exc}")

    device.compute.launch(measure)
    device.compute.record().synchronize()
    torch.set_num_threads(ceiling)  # a setting on the stream's thread also moves the process default (cpu_device.py)
    if chosen:
        device.forward_threads = chosen[0]
