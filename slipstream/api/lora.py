"""The Engine's LoRA adapters: names, device slots, loading off the loop, eviction, unloading
(docs/lora.md).

A name is registered by `load` (EngineConfig.lora_adapters at start, Engine.load_lora later): its
folder is read and checked in a thread (models/lora.py: `load_peft_adapter`) and, when a slot of the
runner is free, installed there (`ModelRunner.set_lora`). At most `max_loras` adapters have weights
in the runner; any number may be registered. A request names an adapter by `SamplingParams.lora`;
`acquire` gives its slot, reading the adapter again in a thread when it is not in one, into a free
slot or the slot of the least recently used idle adapter (evicted). A slot is busy while a live
request (running or waiting in the scheduler: `Submitter.requests`) holds it or while it is being
read; a busy adapter is never evicted, and a request that finds every slot busy waits for one (it
does not fail). The slot travels as `SamplingRow.lora` into the row tables' column; the entry's key
joins the request's block hashes so no KV page is shared across adapters, or across two loads under
one name (a read that finds the files changed since the load gives a new key). Unloading takes the
name away at once; its slot is freed once no live request holds it, so requests already running
finish with it.
"""
from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass
from typing import Any, Callable

from slipstream import validate as check
from slipstream.errors import EngineClosedError, InvalidRequestError, LoraNotFoundError
from slipstream.params import EngineConfig


@dataclass(frozen=True, eq=False)
class LoraEntry:
    """A registered adapter (its weights live in a slot only while resident)."""

    name: str
    path: str
    key: str  # unique per load: the block hashes' extra key (scheduler/block_hash.lora_key)
    rank: int
    targets: tuple[str, ...]
    nbytes: int
    stamp: tuple[tuple[int, int], ...]  # its files' (size, mtime_ns) when read


@dataclass(eq=False)
class _Slot:
    entry: LoraEntry
    used: int  # the registry's clock at its last use: the least recently used idle slot is evicted
    reading: asyncio.Future | None = None  # set while its weights are read (the slot is reserved)


def _read(name: str, path: str, model_config, max_rank: int, dtype, runner):
    """(weights, files' stamp, the bank's staged copy or None): blocking file I/O and checks, run in a
    thread. With a device bank (CUDA) the weights are read to the host and laid out there as one
    slot's entries; set_lora copies them in on the compute stream (models/lora_bank.py)."""
    from slipstream.models.lora import CONFIG_FILE, WEIGHTS_FILE, load_peft_adapter

    bank = runner.forward.lora_bank
    device = runner.device.torch_device if bank is None else "cpu"

    stamp: tuple[tuple[int, int], ...] = ()
    try:
        stats = [os.stat(os.path.join(path, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)]
        stamp = tuple((s.st_size, s.st_mtime_ns) for s in stats)
    except OSError:
        pass  # (load_peft_adapter names what is missing)
    weights = load_peft_adapter(name, path, model_config, max_rank, dtype, device)
    return weights, stamp, None if bank is None else bank.stage(weights)


class LoraRegistry:
    def __init__(self, config: EngineConfig):
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.registered: dict[str, LoraEntry] = {}
        self._slots: dict[int, _Slot] = {}  # slot (1..max_loras) -> what it holds or is reading
        self._where: dict[str, int] = {}  # entry key -> its slot
        self._loading: set[str] = set()
        self._loads = itertools.count(1)
        self._clock = itertools.count(1)
        self._runner: Any = None
        self._reason: str | None = "the engine is not started"
        self._changed: asyncio.Event | None = None
        self.reads = self.evictions = self.waits = 0

    def bind(self, runner, model_config, family_lora: bool, device_kind: str, dtype,
             live_slots: Callable[[], set[int]]) -> None:
        """The running engine's parts; `live_slots`: the slots its live requests hold."""
        self._runner, self._model_config, self._dtype, self._live = runner, model_config, dtype, live_slots
        self._reason = None
        self._changed = asyncio.Event()
        if not family_lora:
            self._reason = "this model's family computes no LoRA adapters (the Llama family does)"
        elif device_kind != "cpu" and runner.forward.lora_bank is None:
            self._reason = ("LoRA on CUDA needs EngineConfig.lora_adapters at start ({} for none yet): the "
                            "adapters' device bank is allocated, and the graphs captured, with it")

    def unbind(self) -> None:
        """The engine closed: hold none of its parts, nor the adapters (start() loads the configured
        ones again; one loaded with load_lora is gone with the engine). Waiting requests fail."""
        self._runner = self._model_config = None
        self.registered.clear()
        self._slots.clear()
        self._where.clear()
        self._reason = "the engine is closed"
        self._notify()

    def _notify(self) -> None:
        """A slot may have become free (or the engine closed): the waiters look again."""
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def resolve(self, name: str) -> LoraEntry:
        entry = self.registered.get(name)
        if entry is None:
            known = ", ".join(sorted(self.registered)) or "none"
            raise LoraNotFoundError(f"lora: no LoRA adapter named {name!r} is loaded (loaded: {known})", param="lora")
        return entry

    # --- slots --------------------------------------------------------------------------------------

    def _evict(self, slot: int) -> None:
        held = self._slots.pop(slot)
        self._where.pop(held.entry.key, None)
        self._runner.set_lora(slot, None)
        if self.registered.get(held.entry.name) is held.entry:
            self.evictions += 1

    def _take_slot(self, evict: bool = True) -> int | None:
        """A free slot, else (evict) the slot of an unloaded or the least recently used idle adapter
        emptied; None when every slot is busy."""
        for slot in range(1, self.max_loras + 1):
            if slot not in self._slots:
                return slot
        if not evict:
            return None
        live = self._live()
        idle = [(self.registered.get(h.entry.name) is h.entry, h.used, s) for s, h in self._slots.items()
                if h.reading is None and s not in live]
        if not idle:
            return None
        slot = min(idle)[2]  # an unloaded adapter's slot first, then the least recently used
        self._evict(slot)
        return slot

    async def acquire(self, name: str) -> tuple[LoraEntry, int]:
        """The adapter named and its slot, read into one if it has none (waiting while every slot is
        busy). The caller holds the slot from the moment it has it in a live request, with no await
        in between (Submitter.submit); LoraAdapterError if the files no longer load."""
        while True:
            if self._runner is None or self._changed is None:
                raise EngineClosedError(f"lora: {self._reason}")
            entry = self.resolve(name)
            slot = self._where.get(entry.key)
            if slot is not None:
                held = self._slots[slot]
                if held.reading is None:
                    held.used = next(self._clock)
                    return entry, slot
                await asyncio.shield(held.reading)  # another request reads it: its failure is ours
                continue
            slot = self._take_slot()
            if slot is None:  # every slot busy: a request's end or an unload frees one
                self.waits += 1
                await self._changed.wait()
                continue
            await asyncio.shield(self._read_into(slot, entry))

    def _read_into(self, slot: int, entry: LoraEntry) -> asyncio.Future:
        """Reserve `slot` for `entry` and read its weights in a thread; the future is done once they
        are installed (or the read failed: the slot is free again, the error is the future's)."""
        done = asyncio.get_running_loop().create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read even with no waiter left)
        self._slots[slot] = _Slot(entry, next(self._clock), done)
        self._where[entry.key] = slot
        self.reads += 1
        runner = self._runner

        async def read() -> None:
            try:
                weights, stamp, staged = await asyncio.to_thread(_read, entry.name, entry.path, self._model_config,
                                                                 self.max_rank, self._dtype, runner)
            except BaseException as e:  # noqa: BLE001 - the waiters get it
                if self._slots.get(slot) is not None and self._slots[slot].reading is done:
                    del self._slots[slot]
                    self._where.pop(entry.key, None)
                done.set_exception(e)
                self._notify()
                return
            if self._runner is not runner:  # the engine closed meanwhile (unbind cleared the slots)
                done.set_result(None)
                return
            held = self._slots[slot]
            if self.registered.get(entry.name) is not entry:  # unloaded while it was read
                del self._slots[slot]
                self._where.pop(entry.key, None)
            else:
                if stamp != entry.stamp:  # the files changed since the load: another key, no shared pages
                    new = LoraEntry(entry.name, entry.path, f"{entry.name}#{next(self._loads)}", weights.rank,
                                    weights.targets, weights.nbytes, stamp)
                    self.registered[entry.name] = held.entry = new
                    self._where.pop(entry.key, None)
                    self._where[new.key] = slot
                runner.set_lora(slot, weights, staged)
                held.reading = None
            done.set_result(None)
            self._notify()

        asyncio.ensure_future(read())
        return done

    def release(self, slot: int) -> None:
        """A live request holding `slot` ended: it counts as a use; an unloaded adapter's memory goes
        once no request holds it; a waiting request may take the slot now."""
        held = self._slots.get(slot)
        if held is not None and held.reading is None:
            held.used = next(self._clock)
            if self.registered.get(held.entry.name) is not held.entry and slot not in self._live():
                self._evict(slot)
        self._notify()

    # --- loading and unloading --------------------------------------------------------------------------

    async def load(self, name: str, path: str) -> LoraEntry:
        """Read, check and register an adapter (LoraAdapterError naming the field; nothing changes then),
        installed in a free slot if there is one (a load evicts nothing: requests read it in later)."""
        check.text("lora_name", name)
        check.text("lora_path", path)
        if self._reason is not None:
            raise InvalidRequestError(f"lora_name: {self._reason}", param="lora_name")
        if name in self.registered or name in self._loading:
            raise InvalidRequestError(f"lora_name: an adapter named {name!r} is already loaded; unload it first",
                                      param="lora_name")
        self._loading.add(name)
        runner = self._runner
        try:
            weights, stamp, staged = await asyncio.to_thread(_read, name, path, self._model_config, self.max_rank,
                                                             self._dtype, runner)
            if self._runner is not runner:
                raise EngineClosedError("lora_name: the engine closed while the adapter was read")
            self.reads += 1
            entry = LoraEntry(name, path, f"{name}#{next(self._loads)}", weights.rank, weights.targets,
                              weights.nbytes, stamp)
            self.registered[name] = entry
            slot = self._take_slot(evict=False)
            if slot is not None:
                self._slots[slot] = _Slot(entry, next(self._clock))
                self._where[entry.key] = slot
                runner.set_lora(slot, weights, staged)
            return entry
        finally:
            self._loading.discard(name)

    def unload(self, name: str) -> None:
        """Take the name away: new requests cannot use it; running ones finish with it (its slot is
        freed after them)."""
        entry = self.resolve(name)
        del self.registered[name]
        slot = self._where.get(entry.key)
        if slot is not None and self._slots[slot].reading is None and slot not in self._live():
            self._evict(slot)  # nothing runs with it: its memory goes now
        self._notify()

    def slot_of(self, name: str) -> int | None:
        """The slot whose weights are the named adapter's (None: not resident, or still being read)."""
        entry = self.registered.get(name)
        slot = None if entry is None else self._where.get(entry.key)
        return slot if slot is not None and self._slots[slot].reading is None else None

    def list(self) -> list[dict[str, Any]]:
        return [{"name": e.name, "path": e.path, "rank": e.rank, "targets": list(e.targets),
                 "slot": self.slot_of(e.name), "bytes": e.nbytes} for e in self.registered.values()]

    def stats(self) -> dict[str, Any]:
        return {"loaded": len(self.registered), "resident": sum(h.reading is None for h in self._slots.values()),
                "reads": self.reads, "evictions": self.evictions, "waits": self.waits}
