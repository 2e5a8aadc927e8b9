"""The Engine's LoRA adapters: names, device slots, loading off the loop, unloading (docs/lora.md).

An adapter is read and checked in a thread (models/lora.py: `load_peft_adapter`), then put in a free
slot of the runner (`ModelRunner.set_lora`) on the loop. A request names an adapter by
`SamplingParams.lora`; `resolve` gives its slot, which travels as `SamplingRow.lora` into the row
tables' column, and its key, which joins the request's block hashes so no KV page is shared across
adapters (or across two loads under one name). Unloading takes the name away at once; its slot is
handed out again only once no live request holds it, so requests already running finish with it.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, Callable

from slipstream import validate as check
from slipstream.errors import InvalidRequestError, LoraNotFoundError
from slipstream.params import EngineConfig


@dataclass(frozen=True, eq=False)
class LoraEntry:
    name: str
    path: str
    slot: int  # its slot in the runner (1..max_loras)
    key: str  # unique per load: the block hashes' extra key (scheduler/block_hash.lora_key)
    rank: int
    targets: tuple[str, ...]
    nbytes: int


class LoraRegistry:
    def __init__(self, config: EngineConfig):
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.loaded: dict[str, LoraEntry] = {}
        self._loading: set[str] = set()
        self._loads = itertools.count(1)
        self._runner: Any = None
        self._reason: str | None = "the engine is not started"

    def bind(self, runner, model_config, family_lora: bool, device_kind: str, dtype,
             live_slots: Callable[[], set[int]]) -> None:
        """The running engine's parts; `live_slots`: the slots its live requests hold."""
        self._runner, self._model_config, self._dtype, self._live = runner, model_config, dtype, live_slots
        self._reason = None
        if not family_lora:
            self._reason = "this model's family computes no LoRA adapters (the Llama family does)"
        elif device_kind != "cpu":
            self._reason = "LoRA runs on the CPU only for now (no CUDA kernels yet)"

    def unbind(self) -> None:
        """The engine closed: hold none of its parts, nor the adapters (start() loads the configured
        ones again; one loaded with load_lora is gone with the engine)."""
        self._runner = self._model_config = None
        self.loaded.clear()
        self._reason = "the engine is closed"

    def resolve(self, name: str) -> LoraEntry:
        entry = self.loaded.get(name)
        if entry is None:
            known = ", ".join(sorted(self.loaded)) or "none"
            raise LoraNotFoundError(f"lora: no LoRA adapter named {name!r} is loaded (loaded: {known})", param="lora")
        return entry

    def _free_slot(self) -> int:
        taken = {e.slot for e in self.loaded.values()} | self._live()
        for slot in range(1, len(self._runner.lora_adapters)):  # unloaded and no longer used: freed
            if slot not in taken and self._runner.lora_adapters[slot] is not None:
                self._runner.set_lora(slot, None)
        for slot in range(1, self.max_loras + 1):
            if slot not in taken:
                return slot
        raise InvalidRequestError(f"lora_name: max_loras={self.max_loras} adapters are loaded or still used by "
                                  "running requests; unload one first", param="lora_name")

    async def load(self, name: str, path: str) -> LoraEntry:
        """Read, check and install an adapter (LoraAdapterError naming the field; nothing changes then)."""
        from slipstream.models.lora import load_peft_adapter

        check.text("lora_name", name)
        check.text("lora_path", path)
        if self._reason is not None:
            raise InvalidRequestError(f"lora_name: {self._reason}", param="lora_name")
        if name in self.loaded or name in self._loading:
            raise InvalidRequestError(f"lora_name: an adapter named {name!r} is already loaded; unload it first",
                                      param="lora_name")
        self._free_slot()  # refused before the read when no slot can be had
        self._loading.add(name)
        try:
            weights = await asyncio.to_thread(load_peft_adapter, name, path, self._model_config, self.max_rank,
                                              self._dtype, self._runner.device.torch_device)
            slot = self._free_slot()
            self._runner.set_lora(slot, weights)
            entry = LoraEntry(name, path, slot, f"{name}#{next(self._loads)}", weights.rank, weights.targets,
                              weights.nbytes)
            self.loaded[name] = entry
            return entry
        finally:
            self._loading.discard(name)

    def unload(self, name: str) -> None:
        """Take the name away: new requests cannot use it; running ones finish with it (their slot
        is reused only after them)."""
        if name not in self.loaded:
            self.resolve(name)  # (raises LoraNotFoundError)
        entry = self.loaded.pop(name)
        if entry.slot not in self._live():  # nothing runs with it: its memory goes now
            self._runner.set_lora(entry.slot, None)

    def list(self) -> list[dict[str, Any]]:
        return [{"name": e.name, "path": e.path, "rank": e.rank, "targets": list(e.targets), "slot": e.slot,
                 "bytes": e.nbytes} for e in self.loaded.values()]
