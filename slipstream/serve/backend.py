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
from slipstream.errors import InvalidRequestError, LoraNotFoundError, WorkerUnavailableError
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
    """Spreads requests over one or more workers: each goes to the one with the fewest in flight.

    LoRA adapters (docs/lora.md, "Over workers"): since any worker may get any request, the server
    serves an adapter only while every worker has it. A load goes to every worker and counts only if
    each took it (else it is unloaded from those that did); an unload takes the name away here first.
    """

    def __init__(self, addresses: list[str], timeout: float = 30.0, model_name: str | None = None):
        from slipstream.api.client import Client

        if not addresses:
            raise ValueError("ClientsBackend needs at least one worker address")
        self.clients = [Client(a, timeout=timeout) for a in addresses]
        self._inflight = [0] * len(addresses)
        self._model_name = model_name
        self._loras: dict[str, dict[str, Any]] = {}  # the adapters every worker has: name -> its load's answer
        self._lora_changing: set[str] = set()  # names a load or unload is fanning out for
        self._lora_synced: list[HealthReply | None] = [None] * len(addresses)  # the handshake _loras was matched to
        self._lora_sync = [asyncio.Lock() for _ in addresses]

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
        self._adopt_loras()
        log.info("workers_connected", workers=[c.address for c in self.clients], model=model)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    @property
    def accepts_images(self) -> bool:
        return all(c.info is not None and c.info.accepts_images for c in self.clients)

    # --- LoRA adapters (serve/lora.py) ----------------------------------------------------------------

    def _adopt_loras(self) -> None:
        """The adapters the workers started with (`slipstream worker --lora`), from their handshakes:
        those on every worker are served; one on some only is not (a request could reach one without it)."""
        infos = [cast(HealthReply, c.info) for c in self.clients]
        per = [{a["name"]: a for a in info.loras} for info in infos]
        common = set(per[0]).intersection(*per[1:])
        self._loras = {name: a for name, a in per[0].items() if name in common}
        self._lora_synced = list(infos)
        partial = sorted(set().union(*per) - common)
        if partial:
            log.warning("lora_adapters_not_on_every_worker", adapters=partial,
                        workers={c.address: sorted(p) for c, p in zip(self.clients, per)})

    def loras(self) -> list[dict[str, Any]]:
        return list(self._loras.values())

    def _claim(self, name: str) -> None:
        if name in self._lora_changing:
            raise InvalidRequestError(f"lora_name: the adapter {name!r} is being loaded or unloaded; retry",
                                      param="lora_name")
        self._lora_changing.add(name)

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        if name in self._loras:
            raise InvalidRequestError(f"lora_name: an adapter named {name!r} is already loaded; unload it first",
                                      param="lora_name")
        self._claim(name)
        try:  # shielded: a caller that goes away does not leave the fan-out (or its undoing) half done
            return await asyncio.shield(self._load_everywhere(name, path))
        finally:
            self._lora_changing.discard(name)

    async def _load_everywhere(self, name: str, path: str) -> dict[str, Any]:
        got = await asyncio.gather(*(c.load_lora(name, path) for c in self.clients), return_exceptions=True)
        failed = [(c, r) for c, r in zip(self.clients, got) if isinstance(r, BaseException)]
        if not failed:
            self._loras[name] = adapter = cast(dict, got[0])
            return adapter
        took = [c for c, r in zip(self.clients, got) if not isinstance(r, BaseException)]
        undone = await asyncio.gather(*(c.unload_lora(name) for c in took), return_exceptions=True)
        stuck = [c.address for c, r in zip(took, undone) if isinstance(r, BaseException)]
        log.warning("lora_load_refused", adapter=name, refused_by={c.address: repr(e) for c, e in failed},
                    left_loaded_on=stuck)  # (stuck: unreachable now; a restarted worker has it no more)
        raise failed[0][1]

    async def unload_lora(self, name: str) -> None:
        if name not in self._loras:
            known = ", ".join(sorted(self._loras)) or "none"
            raise LoraNotFoundError(f"lora: no LoRA adapter named {name!r} is loaded (loaded: {known})", param="lora")
        self._claim(name)
        del self._loras[name]  # no new request names it from now on, whatever the workers answer
        try:
            got = await asyncio.shield(asyncio.gather(*(c.unload_lora(name) for c in self.clients),
                                                      return_exceptions=True))
        finally:
            self._lora_changing.discard(name)
        failed = [(c, r) for c, r in zip(self.clients, got)
                  if isinstance(r, BaseException) and not isinstance(r, LoraNotFoundError)]  # (gone there already)
        if failed:
            log.warning("lora_unload_failed", adapter=name, workers={c.address: repr(e) for c, e in failed})
            raise failed[0][1]

    async def _with_loras(self, i: int, params: SamplingParams) -> None:
        """A worker that reconnected may be a new process (restarted without the adapters loaded here):
        before it serves an adapter's request, it loads the served adapters it lacks."""
        c = self.clients[i]
        if params.lora is None or c.info is self._lora_synced[i]:
            return
        async with self._lora_sync[i]:
            info = c.info
            if info is self._lora_synced[i]:
                return
            have = {a["name"] for a in (await c.health()).loras}
            missing = [(name, a) for name, a in self._loras.items() if name not in have]
            for name, a in missing:
                try:
                    await c.load_lora(name, a["path"])
                except InvalidRequestError as e:
                    raise WorkerUnavailableError(f"the worker at {c.address} came back without the LoRA "
                                                 f"adapter {name!r} and refused to load it: {e}") from e
            if missing:
                log.info("lora_adapters_reloaded", worker=c.address, adapters=[name for name, _ in missing])
            self._lora_synced[i] = info

    def _pick(self) -> int:
        live = [i for i, c in enumerate(self.clients) if not c.draining and not c.connection.closed]
        if not live:
            raise WorkerUnavailableError("no worker is accepting requests (all draining or gone)")
        return min(live, key=lambda i: self._inflight[i])

    async def stream(self, ids, params, request_id, images=()):
        i = self._pick()
        self._inflight[i] += 1
        try:
            await self._with_loras(i, params)
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
            await self._with_loras(i, params)
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
