"""What the HTTP layer serves from: an in-process Engine, or `slipstream worker`s through Clients.

Both take prompts as token ids: the server applies the chat template and tokenizes once, so
usage counts, logprob token strings and /tokenize come from the same tokenizer in both modes.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncIterator, Protocol, Sequence, cast

import structlog

from slipstream.api.interface import DeltaStream
from slipstream.api.protocol import HealthReply
from slipstream.errors import WorkerUnavailableError
from slipstream.images import ImageInput, model_accepts_images
from slipstream.outputs import CompletionOutput, StreamDelta
from slipstream.params import EngineConfig, SamplingParams

log = structlog.get_logger(__name__)


class Backend(Protocol):
    model_name: str
    tokenizer: Any  # encode / decode / apply_chat_template
    vocab_size: int
    max_model_len: int | None  # None: not known here (the worker checks)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    # `prompt`: token ids; text (with `<image>` markers) when `images` are given (the engine expands them)
    def stream(self, prompt: list[int] | str, params: SamplingParams, request_id: str,
               images: Sequence[ImageInput] = ()) -> DeltaStream: ...

    async def complete(self, prompt: list[int] | str, params: SamplingParams, request_id: str,
                       images: Sequence[ImageInput] = ()) -> CompletionOutput: ...

    async def stats(self) -> dict: ...

    async def metrics_text(self) -> str: ...  # Prometheus text of the engine's registry ("" if not served here)

    # optional (/v1/point, /v1/detect; a backend without it answers 501): the engine's skill result dict
    # async def skill(self, kind: str, obj: str, max_objects: int, images: list[ImageInput]) -> dict: ...


class EngineBackend:
    """The engine runs on the server's event loop (uvloop under uvicorn)."""

    def __init__(self, config: EngineConfig, model_name: str | None = None):
        from slipstream.api.engine import Engine

        self.engine = Engine(config)
        self.model_name = model_name or config.model

    async def start(self) -> None:
        await self.engine.start()
        self.tokenizer = self.engine.tokenizer
        self.vocab_size = self.engine.model_config.vocab_size
        self.max_model_len = self.engine.max_model_len
        self.max_prompt_chars = self.engine.config.max_prompt_chars

    async def close(self) -> None:
        await self.engine.close()

    @property
    def accepts_images(self) -> bool:
        return model_accepts_images(self.engine.model_config)

    def stream(self, ids, params, request_id, images=()):
        return self.engine.stream(ids, params, request_id=request_id, **_images_kw(images))

    async def complete(self, ids, params, request_id, images=()):
        return await self.engine.complete(ids, params, request_id=request_id, **_images_kw(images))

    async def skill(self, kind: str, obj: str, max_objects: int, images: list[ImageInput]) -> dict:
        """`Engine.point` / `Engine.detect` (slipstream/api/skills.py): what the in-process API returns."""
        return await getattr(self.engine, kind)("", obj, max_objects, images=list(images))

    async def stats(self) -> dict:
        return await self.engine.stats()

    async def metrics_text(self) -> str:
        return await self.engine.metrics_text()

    def loras(self) -> list[dict]:  # LoRA adapters (serve/lora.py)
        return self.engine.loras()

    async def load_lora(self, name: str, path: str) -> dict:
        return await self.engine.load_lora(name, path)

    async def unload_lora(self, name: str) -> None:
        await self.engine.unload_lora(name)


class ClientsBackend:
    """Spreads requests over one or more workers: each goes to the one with the fewest in flight."""

    def __init__(self, addresses: list[str], timeout: float = 30.0, model_name: str | None = None):
        from slipstream.api.client import Client

        if not addresses:
            raise ValueError("ClientsBackend needs at least one worker address")
        self.clients = [Client(a, timeout=timeout) for a in addresses]
        self._inflight = [0] * len(addresses)
        self._model_name = model_name

    async def start(self) -> None:
        from slipstream.serve.tokenizer_load import load_tokenizer

        await asyncio.gather(*(c.start() for c in self.clients))
        models = {cast(HealthReply, c.info).model for c in self.clients}  # (started: each has its handshake)
        if len(models) != 1:
            await self.close()
            raise WorkerUnavailableError(f"workers serve different models: {sorted(models)}")
        model = models.pop()
        self.model_name = self._model_name or model
        self.tokenizer, self.vocab_size = await asyncio.to_thread(load_tokenizer, model)
        lens = [cast(HealthReply, c.info).max_model_len for c in self.clients]
        self.max_model_len = min(lens) if all(lens) else None  # (None: a worker did not say; each checks)
        log.info("workers_connected", workers=[c.address for c in self.clients], model=model)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    @property
    def accepts_images(self) -> bool:
        return all(c.info is not None and c.info.accepts_images for c in self.clients)

    def _pick(self) -> int:
        live = [i for i, c in enumerate(self.clients) if not c.draining and not c.connection.closed]
        if not live:
            raise WorkerUnavailableError("no worker is accepting requests (all draining or gone)")
        return min(live, key=lambda i: self._inflight[i])

    async def stream(self, ids, params, request_id, images=()):
        i = self._pick()
        self._inflight[i] += 1
        try:
            async with aclosing(self.clients[i].stream(ids, params, request_id=request_id,
                                                       **_images_kw(images))) as deltas:
                async for delta in deltas:  # closing it early aborts the request on the worker
                    yield delta
        finally:
            self._inflight[i] -= 1

    async def complete(self, ids, params, request_id, images=()):
        i = self._pick()
        self._inflight[i] += 1
        try:
            return await self.clients[i].complete(ids, params, request_id=request_id, **_images_kw(images))
        finally:
            self._inflight[i] -= 1

    async def skill(self, kind: str, obj: str, max_objects: int, images: list[ImageInput]) -> dict:
        i = self._pick()
        self._inflight[i] += 1
        try:
            return await getattr(self.clients[i], kind)("", obj, max_objects, images=list(images))
        finally:
            self._inflight[i] -= 1

    async def stats(self) -> dict:
        per = await asyncio.gather(*(c.stats() for c in self.clients), return_exceptions=True)
        ok = [s for s in per if isinstance(s, dict)]
        total = {k: sum(s.get(k, 0) for s in ok) for k in ("kv_pages_free", "kv_pages_total", "running", "waiting")}
        return {**total, "workers": [s if isinstance(s, dict) else {"error": repr(s)} for s in per]}

    async def metrics_text(self) -> str:
        return ""  # each worker serves its own registry (`slipstream worker --metrics-port`)


def _images_kw(images) -> dict:
    """`images=` only when there are some: text requests call the engine exactly as before."""
    return {"images": list(images)} if images else {}
