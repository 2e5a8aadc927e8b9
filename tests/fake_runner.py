"""A torch-free stand-in for ModelRunner, so the scheduler's invariants are tested without a device.

It is at least as asynchronous as the real device: launched work goes into FIFO "streams" (asyncio
tasks) that run each item after a random number of loop passes; the copy stream really waits on
the compute stream's event; the forward reads its inputs (rows' last tokens, KV) when it runs, not
when it is launched. Its "model" is a pure function of the context tokens, read back from a fake
paged KV store written at the step's KV indices — so a page released too early, reused while
in flight, or fed the wrong last token changes the output and the test sees it.

Structural check (`Referee`): a KV page or a row must never be handed out while a
launched, uncommitted step references it. The test installs the referee into the planner's page
pool and free-row list; a violation raises at the hand-out, which kills the loop and fails the test.
Prefix cache: a page registered in the cache must never be written by a step (checked at launch
against the pool's registered pages), and a page may be registered only when no in-flight step
writes it (checked at `register`: registering before the commit that completed it is caught).

Page-table writes: a step's entries reach the device as one scatter (`RowTables.apply`), and with
a repeated (row, index) CUDA leaves which value lands undefined (the CPU applies them in order, the
last winning). The fake keeps one of the repeats as the real device may: the first, or one chosen
at random (`duplicate_writes`, default "random"); the referee follows the same choice, and fails
a step whose entries map one place to two pages. So a step that carries a stale entry beside a new
one for the same place fails a test here too.

Images: an ImageSpan's `processed` is a tuple of ints (its "pixels"); the fake encoder turns them
into `num_features` ints (`fake_features`), and the forward writes those, not the placeholder ids,
into the KV at the image's positions — so a feature fed to the wrong position, a missing encode or
an output dropped too early changes the output (`reference` with `images`). The referee also
fails a run that drops an encoder output an in-flight step reads.

Prompts are [marker, prompt_len, ...]: marker 1000 + k means "EOS as output token k".

The carry (runtime/step/carry.py): a row whose chunk declares carry tokens (SamplingRow.carry, here
CARRY_MAP) samples them from its model (`next_token(..., carries=True)`); the sampling then
decodes a value from the context (`head_value`) into the device's carry table, and the next input of
the row is that value (`carry_input`, in the context) instead of the token. The carry table is
`DeviceOnly`: a read or write outside the fake device's stream work raises, so a host that read the
values between steps fails the test; the values reach the host only through the step's copy.
"""
from __future__ import annotations

import asyncio
import inspect
import random

from slipstream.faults import InjectedFault
from slipstream.runtime.runner_api import SampledTokens
from slipstream.scheduler.page_pool import PagePool

EOS = 2
VOCAB = 300
IMAGE = 1  # the placeholder id
CARRY_MAP = {5: 1, 6: 2}  # carry token -> kind (kind k has k values)


class _Device:
    active = False  # True while a fake stream runs an item: device work, not the host


def on_device(fn):
    """Run `fn` as device work (what a fake stream does with each item it runs)."""
    _Device.active = True
    try:
        return fn()
    finally:
        _Device.active = False


class DeviceOnly(dict):
    """A device table: any access outside stream work is a host read (or write) and raises."""

    def _check(self) -> None:
        if not _Device.active:
            raise AssertionError("host access to the carry table between steps")

    def __getitem__(self, key):
        self._check()
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        self._check()
        super().__setitem__(key, value)

    def get(self, key, default=None):
        self._check()
        return super().get(key, default)


def head_value(context: list[int], kind: int) -> tuple[float, ...]:
    s = sum(context)
    return tuple(((s * 13 + len(context) * 7 + 101 * i + kind) % 1000) / 1000 for i in range(kind))


def carry_input(kind: int, values: tuple[float, ...]) -> int:
    """What the fake model sees at a position fed a head value: the kind and every value, as one int."""
    return kind * 10**6 + sum(round(v * 1000) * 1000**i for i, v in enumerate(values))


def make_prompt(length: int, eos_at: int | None, salt: int) -> list[int]:
    body = [3 + (salt * 31 + i * 17) % (VOCAB - 3) for i in range(max(length - 2, 0))]
    return [1000 + eos_at if eos_at is not None else 3 + salt % 50, length] + body


def next_token(context: list[int], carries: bool = False) -> int:
    first, prompt_len = context[0], context[1]
    if first >= 1000 and len(context) - prompt_len == first - 1000:
        return EOS
    tok = 3 + (sum(context) * 7 + len(context) * 13) % (VOCAB - 3)
    if carries and tok % 3 == 0:  # a row with carry tokens samples them often
        return 5 if tok % 2 else 6
    return tok


def fake_features(pixels: tuple[int, ...], n: int) -> list[int]:
    return [3 + (sum(pixels) * 7 + i * 11 + pixels[i % len(pixels)]) % (VOCAB - 3) for i in range(n)]


def reference(prompt: list[int], max_tokens: int, images=(), carries: bool = False) -> list[int]:
    return reference_carry(prompt, max_tokens, carries, images)[0]


def reference_carry(prompt: list[int], max_tokens: int, carries: bool = False, images=()):
    """(tokens, {output index: head values}) of a request decoded alone, one token at a time."""
    ctx, out, carried = list(prompt), [], {}
    for span in images:  # the model sees the encoder's rows at the image's positions
        for pos, value in zip(span.positions, fake_features(span.processed, span.num_features)):
            ctx[int(pos)] = value
    while len(out) < max_tokens:
        tok = next_token(ctx, carries)
        out.append(tok)
        kind = CARRY_MAP.get(tok, 0) if carries else 0
        if kind:
            carried[len(out) - 1] = head_value(ctx, kind)
            ctx.append(carry_input(kind, carried[len(out) - 1]))
        else:
            ctx.append(tok)
        if tok == EOS:
            break
    return out, carried


class NullDetok:
    """A detokeniser for token-only tests: no text."""

    def push(self, ids):
        return ""

    def flush(self):
        return ""


class Referee:
    """Which pages and rows launched-but-uncommitted steps reference; hand-outs are checked against it."""

    def __init__(self) -> None:
        # step id -> (pages, rows, pages written, image digests read)
        self.steps: dict[int, tuple[set[int], set[int], set[int], set[bytes]]] = {}
        self.pool: PagePool | None = None  # the refereed pool (its registered pages)
        self.refresh = None  # fn() bringing lazily known write sets up to date (speculating steps)

    def referenced(self, kind: int) -> set[int]:
        if kind == 2 and self.refresh is not None:
            self.refresh()
        return set().union(*(refs[kind] for refs in self.steps.values())) if self.steps else set()

    def check_hand_out(self, what: str, items, kind: int) -> None:
        busy = self.referenced(kind) & set(items)
        if busy:
            raise AssertionError(f"{what} {sorted(busy)} handed out while an in-flight step references them")

    def check_drop(self, digests) -> None:
        busy = self.referenced(3) & set(digests)
        if busy:
            raise AssertionError(f"encoder outputs {sorted(busy)} dropped while an in-flight step reads them")

    def check_register(self, page: int) -> None:
        if page in self.referenced(2):
            raise AssertionError(f"page {page} registered in the prefix cache while an in-flight step writes it")

    @staticmethod
    def check_scatter(writes: list[tuple[int, int, int]]) -> None:
        pages: dict[tuple[int, int], int] = {}
        for row, index, page in writes:
            if pages.setdefault((row, index), page) != page:
                raise AssertionError(f"a step maps row {row} index {index} to pages {pages[row, index]} and {page}: "
                                     "one scatter with repeated indices (undefined on CUDA)")

    def check_writes(self, written: set[int]) -> None:
        cached = written & self.pool.registered if self.pool is not None else set()
        if cached:
            raise AssertionError(f"a step writes K/V into pages {sorted(cached)} registered in the prefix cache")


class RefereedPool(PagePool):
    def __init__(self, num_pages: int, referee: Referee):
        super().__init__(num_pages)
        self.referee = referee
        referee.pool = self

    def allocate(self, n: int) -> list[int]:
        pages = super().allocate(n)
        self.referee.check_hand_out("pages", pages, 0)
        return pages

    def register(self, page: int) -> None:
        self.referee.check_register(page)
        super().register(page)


class RefereedRows(list):
    def __init__(self, rows, referee: Referee):
        super().__init__(rows)
        self.referee = referee

    def pop(self, *args):
        row = super().pop(*args)
        self.referee.check_hand_out("row", [row], 1)
        return row


class FakeEvent(asyncio.Event):
    error: BaseException | None = None  # the recording stream's error when it completed


class FakeStream:
    """FIFO work on an asyncio task; each item runs after 0..max_delay loop passes. Like the real
    streams (runtime/devices/cpu_device.py), an item that raises makes the error sticky: later work is
    skipped, events still complete and carry the error, until `clear_error` (the runner's recover)."""

    def __init__(self, rng: random.Random, max_delay: int):
        self.rng, self.max_delay = rng, max_delay
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.error: BaseException | None = None

    def launch(self, fn, event_op: bool = False) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())
        self.queue.put_nowait((fn, event_op))

    def record(self) -> FakeEvent:
        event = FakeEvent()

        def complete() -> None:
            event.error = self.error
            event.set()

        self.launch(complete, event_op=True)
        return event

    def wait(self, event: FakeEvent) -> None:
        async def wait() -> None:
            await event.wait()
            if event.error is not None and self.error is None:
                self.error = event.error

        self.launch(wait, event_op=True)

    def clear_error(self) -> None:
        self.error = None

    async def _run(self) -> None:
        while True:
            fn, event_op = await self.queue.get()
            for _ in range(self.rng.randint(0, self.max_delay)):
                await asyncio.sleep(0)
            if self.error is not None and not event_op:
                continue
            try:
                result = on_device(fn)
                if inspect.isawaitable(result):
                    await result
            except Exception as e:  # noqa: BLE001 - kept, surfaced through events
                self.error = e


class FakeSlot:
    """Buffers of a step in flight (here: its landing site), free or owned by one FakeLaunch."""

    def __init__(self, index: int):
        self.index, self.owner = index, None

    def release(self) -> None:
        assert self.owner is not None
        self.owner = None


class FakeLaunch:
    """The fake's record of one launched step (the runner's Launched)."""

    def __init__(self, step_id: int, slot: FakeSlot, packed):
        self.step_id, self.slot, self.packed = step_id, slot, packed
        self.contexts: list[list[int]] = []
        self.sampled: dict[int, int] = {}
        self.carried: dict[int, tuple[int, tuple[float, ...]]] = {}  # sampling row -> (kind, values)
        self.host_carried: dict | None = None
        self.host_result: list[int] | None = None
        self.copied: FakeEvent | None = None
        self.sample_rows: list[int] = []
        self.runs: list[list[int]] | None = None  # a speculating step's emitted tokens per decode row
        self.host_runs: list[list[int]] | None = None


class FakeRunner:
    def __init__(self, page_size: int, seed: int = 0, max_delay: int = 3, duplicate_writes: str = "random"):
        assert duplicate_writes in ("first", "last", "random"), duplicate_writes
        self.page_size, self.duplicate_writes = page_size, duplicate_writes
        self.slots = [FakeSlot(0), FakeSlot(1)]
        self.kv: dict[int, int] = {}  # KV index -> token
        self.last_token: dict[int, int] = {}  # row -> its newest sampled token
        self.dev_pages: dict[int, list[int]] = {}  # row -> page-table row, as the "device" has it
        self.dev_pos: dict[int, int] = {}  # row -> next position, as the "device" has it
        self.launch_pages: dict[int, list[int]] = {}  # the same tables as launch order has them
        self.launch_pos: dict[int, int] = {}
        self.referee = Referee()
        self._rng = random.Random(seed)
        self._max_delay = max_delay
        self._streams: tuple[FakeStream, FakeStream] | None = None
        # step ids that raise on the "device" at their first work: the encoder when the step has
        # encodes (they never run: the failed stream skips them), else the forward (before its
        # row-table writes)
        self.fail_steps: set[int] = set()
        self._encodes: list = []  # the next step's encodes: launched with its forward (the step id)
        self.features: dict[bytes, list[int]] = {}  # encoder outputs by digest, as the "device" has them
        self.encodes: list[bytes] = []  # digests encoded, in launch order
        self.missing_features = 0  # image rows a forward found no encoder output for

        self.carry_values = DeviceOnly()  # row -> head values its newest token carries (the carry table)
        self.carry_maps = DeviceOnly()  # row -> {carry token: kind}, written by its chunks
        # speculation: rows whose launch-order position is optimistic (a speculating step planned as
        # if every draft were accepted, since their last chunk), and, per launched step not run
        # yet, what it may write (the referee's view: from the device's position now to the
        # optimistic end); the forward replaces that with what it wrote
        self.optimistic: set[int] = set()
        self._lazy: dict[int, tuple[set[int], set[int], list[tuple[int, int, int, int | None]]]] = {}
        # the referee's lower bound of where a launched step's row starts writing: the device position
        # only while the device has run the row's last chunk (before that it is the row's previous
        # holder's), else what the host knows at launch: a chunk's end, plus a token per step since
        self.pos_floor: dict[int, int] = {}
        self.row_chunk: dict[int, int] = {}  # row -> step id of its last chunk launched
        self.dev_chunk: dict[int, int] = {}  # row -> step id of its last chunk run on the device
        self.referee.refresh = self._refresh_lazy
        self.drafts_fed = self.drafts_accepted = 0
        # the device's clock (SampledTokens.step_ms): fn(rows, positions, speculating) -> ms of a decode step
        self.step_cost = None
        self.speculating_steps = self.decode_steps = 0

    def launch_encoder(self, images) -> None:
        """Queued right before the step's forward (as the loop calls them), on the same stream."""
        self._encodes += list(images)

    def _launch_encodes(self, step_id: int) -> None:
        spans, self._encodes = self._encodes, []
        self.encodes += [s.digest for s in spans]

        def encode() -> None:
            if step_id in self.fail_steps:
                raise InjectedFault(f"injected encoder fault (at {step_id})")
            for span in spans:
                self.features[span.digest] = fake_features(span.processed, span.num_features)

        if spans:
            self.streams[0].launch(encode)

    def drop_features(self, digests) -> None:
        self.referee.check_drop(digests)
        for d in digests:
            self.features.pop(d, None)

    @property
    def streams(self) -> tuple[FakeStream, FakeStream]:
        if self._streams is None:  # made on first use: they need the running loop
            self._streams = (FakeStream(self._rng, self._max_delay), FakeStream(self._rng, self._max_delay))
        return self._streams

    def launch_forward(self, step_id, packed, unmasked=False) -> FakeLaunch:
        slot = next((s for s in self.slots if s.owner is None), None)
        assert slot is not None, "no free slot: more steps in flight than the depth"
        step = slot.owner = FakeLaunch(step_id, slot, packed)
        # the persistent batch as the host's launch order sees it (what the step will reference)
        writes = [tuple(int(x) for x in w) for w in packed.page_writes]
        self.referee.check_scatter(writes)
        writes = self._scatter(writes)
        for row, index, page in writes:
            self._apply_page(self.launch_pages, row, index, page)
        dec = [int(r) for r in packed.decode_rows]
        drafts = [0] * len(dec) if packed.num_drafts is None else [int(k) for k in packed.num_drafts]
        seq_rows, kv_lens, written = [], [], set()
        lazy: list[int] = []  # rows whose position only the device knows
        for r, k in zip(dec, drafts):
            seq_rows.append(r)
            if k:
                self.optimistic.add(r)
            kv_lens.append(self.launch_pos.get(r, 0) + 1 + k)
            self.launch_pos[r] = kv_lens[-1]
            if r in self.optimistic:  # it writes from its device position on, up to the optimistic end
                lazy.append((r, kv_lens[-1], self.pos_floor.get(r, 0), self.row_chunk.get(r)))
                self.pos_floor[r] = self.pos_floor.get(r, 0) + 1  # a run emits at least one token
                continue
            self.pos_floor[r] = kv_lens[-1]
            written.add(self.launch_pages[r][(kv_lens[-1] - 1) // self.page_size])
        chunks = [(w.row, list(w.tokens), w.start_pos, w.sample) for w in packed.chunks]
        images = [(w.row, w.start_pos, part) for w in packed.chunks for part in w.images]
        chunk_maps = [(w.row, dict(w.sampling.carry)) for w in packed.chunks]
        for (_, tokens, _, _), w in zip(chunks, packed.chunks):
            for offset, kind, values in w.carry:  # a recompute re-feeds the values the host kept
                tokens[offset] = carry_input(kind, values)
        for row, tokens, start, _ in chunks:
            self.launch_pos[row] = self.pos_floor[row] = start + len(tokens)
            self.row_chunk[row] = step_id
            self.optimistic.discard(row)
            seq_rows.append(row)
            kv_lens.append(start + len(tokens))
            written |= {self.launch_pages[row][p // self.page_size] for p in range(start, start + len(tokens))}
        pages = set()
        for r, kv in zip(seq_rows, kv_lens):
            pages |= set(self.launch_pages[r][: -(-kv // self.page_size)])
        static_written = set(written)
        if lazy:
            self._lazy[step_id] = (written, static_written, lazy)
            self._refresh_lazy()
        self.referee.check_writes(written)
        self.referee.steps[step_id] = (pages, set(seq_rows), written, {part.digest for _, _, part in images})
        if packed.num_drafts is not None:
            step.runs = [[] for _ in dec]
        if not packed.chunks:
            self.decode_steps += 1
            self.speculating_steps += packed.num_drafts is not None

        def forward() -> None:  # reads the row tables as they are when it runs (stream order)
            if step_id in self.fail_steps:
                raise InjectedFault(f"injected forward fault (at {step_id})")
            for row, index, page in writes:
                self._apply_page(self.dev_pages, row, index, page)
            for row, carry_map in chunk_maps:  # a chunk rewrites its row's parameters
                self.carry_maps[row] = carry_map
            tokens_at = []  # (row, position, token)
            for r, k in zip(dec, drafts):
                pos = self.dev_pos.get(r, 0)
                tok = self.last_token[r]
                kind = self.carry_maps.get(r, {}).get(tok, 0)
                tokens_at.append((r, pos, carry_input(kind, self.carry_values[r]) if kind else tok))
                if step.runs is None:
                    self.dev_pos[r] = pos + 1
            if step.runs is not None:  # speculating rows: drafts, K/V of every position, verify
                self._forward_drafts(step, dec, drafts, tokens_at)
                return
            if step_id in self._lazy:
                self._settle(step_id, [(r, p, p + 1) for r, p, _ in tokens_at])
            for row, tokens, start, _ in chunks:
                tokens_at += [(row, start + i, t) for i, t in enumerate(tokens)]
                self.dev_pos[row] = start + len(tokens)
                self.dev_chunk[row] = step_id
            for row, start, part in images:  # image rows take the encoder's output (read now: stream order)
                feats = self.features.get(part.digest)
                if feats is None:
                    self.missing_features += 1
                for t, f in zip(part.token_index, part.feature_index):
                    tokens_at.append((row, start + int(t), -1 if feats is None else feats[int(f)]))
            for row, pos, tok in tokens_at:
                self.kv[self._kv_index(row, pos)] = tok
            sampling = [(r, self.dev_pos[r]) for r in dec] + [(row, start + len(tokens))
                                                              for row, tokens, start, sample in chunks if sample]
            step.contexts = [[self.kv[self._kv_index(r, p)] for p in range(kv)] for r, kv in sampling]

        step.sample_rows = [int(r) for r in packed.sample_rows]
        self._launch_encodes(step_id)
        self.streams[0].launch(forward)
        if unmasked:
            self.launch_sampling(step)
        return step

    def _refresh_lazy(self) -> None:
        """What each launched, not yet run step may write: its rows' pages from where they start (no
        lower: the device position now, once it is the row's holder's, else the host's bound) to the
        optimistic end of the step."""
        for written, static, lazy in self._lazy.values():
            written.clear()
            written |= static
            for r, end, floor, chunk in lazy:
                start = max(floor, self.dev_pos.get(r, 0)) if self.dev_chunk.get(r) == chunk else floor
                pages = self.launch_pages[r]
                written |= {pages[p // self.page_size] for p in range(start, end)}

    def _settle(self, step_id: int, spans: list[tuple[int, int, int]]) -> None:
        """The step ran: what it wrote, (row, start, end) positions, replaces the referee's bound."""
        written, static, _ = self._lazy.pop(step_id)
        written.clear()
        written |= static
        for r, lo, hi in spans:
            for p in range(lo, hi):
                index = p // self.page_size
                pages = self.dev_pages.get(r, [])
                assert index < len(pages) and pages[index] != 0, f"row {r} writes position {p} without a page"
                written.add(pages[index])
        self.referee.check_writes(written)

    def _forward_drafts(self, step: FakeLaunch, dec: list[int], drafts: list[int], inputs) -> None:
        """A speculating step on the device: each row's drafts (a fake drafter that is right two times
        in three, by a hash of the context), K/V of its k + 1 positions, then replay acceptance:
        the longest prefix of drafts equal to what the model says at each position, and one more."""
        spans, contexts = [], []
        for i, ((r, pos, first), k) in enumerate(zip(inputs, drafts)):
            ctx = [self.kv[self._kv_index(r, p)] for p in range(pos)] + [first]
            guess = list(ctx)
            fed = [first]
            for j in range(k):
                right = next_token(guess)
                d = right if (sum(guess) * 31 + j) % 3 else 3 + (right + 1) % (VOCAB - 3)
                fed.append(d)
                guess.append(d)
            for j, tok in enumerate(fed):
                self.kv[self._kv_index(r, pos + j)] = tok
            spans.append((r, pos, pos + k + 1))
            contexts.append([self.kv[self._kv_index(r, p)] for p in range(pos + k + 1)])
        self._settle(step.step_id, spans)
        for i, ((r, pos, _), k, ctx) in enumerate(zip(inputs, drafts, contexts)):
            run = []
            for j in range(k + 1):
                target = next_token(ctx[:pos + j + 1])
                run.append(target)
                if j == k or ctx[pos + j + 1] != target:
                    break
            self.drafts_fed += k
            self.drafts_accepted += len(run) - 1
            step.runs[i] = run
            self.last_token[r] = run[-1]
            self.dev_pos[r] = pos + len(run)

    def _scatter(self, writes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """The entries one scatter leaves in the table: of a repeated (row, index), the one this
        device picks (undefined on CUDA: first, last or any)."""
        by_place: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for w in writes:
            by_place.setdefault(w[:2], []).append(w)
        if len(by_place) == len(writes):
            return writes
        pick = {"first": lambda ws: ws[0], "last": lambda ws: ws[-1], "random": self._rng.choice}[self.duplicate_writes]
        return [pick(ws) for ws in by_place.values()]

    def _kv_index(self, row: int, pos: int) -> int:
        return self.dev_pages[row][pos // self.page_size] * self.page_size + pos % self.page_size

    @staticmethod
    def _apply_page(table: dict, row: int, index: int, page: int) -> None:
        pages = table.setdefault(row, [])
        pages.extend([0] * (index + 1 - len(pages)))
        pages[index] = page

    def launch_sampling(self, step, rows=None, bitmask=None, final=True) -> None:
        compute, copy = self.streams
        n = step.packed.num_samples
        rows = list(range(n)) if rows is None else list(rows)
        table_rows = step.sample_rows

        def sample() -> None:
            if step.runs is not None:  # (verified in its forward)
                return
            for i in rows:
                carry_map = self.carry_maps.get(table_rows[i], {})
                tok = next_token(step.contexts[i], bool(carry_map))
                self.last_token[table_rows[i]] = tok
                step.sampled[i] = tok
                kind = carry_map.get(tok, 0)
                if kind:  # its next input is this value, decoded from this step's "hidden state"
                    values = head_value(step.contexts[i], kind)
                    self.carry_values[table_rows[i]] = values
                    step.carried[i] = (kind, values)

        compute.launch(sample)
        if final:
            copy.wait(compute.record())  # the copy waits for exactly this step's sampling

            def copy_out() -> None:
                if step.runs is not None:
                    step.host_runs = [list(run) for run in step.runs]
                    step.host_result = [run[-1] for run in step.host_runs]
                    return
                step.host_result = [step.sampled[i] for i in range(n)]
                step.host_carried = dict(step.carried) or None

            copy.launch(copy_out)
            step.copied = copy.record()  # carries a failed stream's error to read_sampled

    def is_done(self, step) -> bool:
        return step.copied is not None and step.copied.is_set()

    async def read_sampled(self, step) -> SampledTokens:
        await step.copied.wait()
        if getattr(step.copied, "error", None) is not None:
            raise step.copied.error
        self.referee.steps.pop(step.step_id)
        if step.host_runs is not None:  # as the host corrects its count: the rejected drafts' positions
            for r, k, run in zip(step.packed.decode_rows, step.packed.num_drafts, step.host_runs):
                self.launch_pos[int(r)] -= int(k) + 1 - len(run)
        step.slot.release()
        ms = None
        packed = step.packed
        if self.step_cost is not None and not packed.chunks:
            rows = len(packed.decode_rows)
            drafts = 0 if packed.num_drafts is None else int(sum(packed.num_drafts))
            ms = self.step_cost(rows, rows + drafts, packed.num_drafts is not None)
        return SampledTokens(step.host_result, None, None, step.host_carried, step.host_runs, step_ms=ms)

    async def drain(self) -> None:
        for stream in self.streams:
            await stream.record().wait()

    def recover(self, steps) -> bool:
        for stream in self.streams:
            stream.clear_error()
        for step in steps:
            self.referee.steps.pop(step.step_id, None)
            self._lazy.pop(step.step_id, None)
            if step.slot.owner is step:
                step.slot.release()
        return True
