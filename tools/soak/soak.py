"""Soak: thousands of random requests with injected faults; nothing lost, duplicated, leaked or wrong.

    python tools/soak/soak.py --requests 5000 --seed 1     # the figure in docs/reliability.md
    python tools/soak/soak.py --requests 500 --rounds 2    # what `make test` runs (tests/test_soak.py)
    python tools/soak/soak.py --requests 10000 --output-stage thread --slow-detok-ms 0.3 --switch-interval 1e-6
                                                           # the threaded stage shaken (issue 27)

One depth-2 engine (tiny-random, a KV pool small enough to force preemption) serves rounds of
requests: random arrivals and bursts of 200, prompt lengths, max_tokens, stop strings and ids,
greedy / seeded / unseeded sampling, regex and choice grammars, and ~15% cancellations of all
three kinds (cancel the task awaiting complete(), break out of stream(), engine.abort(id)).
Faults are injected at random into forwards, sampling, grammar matchers and detokenisation.
Checked: every request ends exactly once, with a result or a typed SlipstreamError, before its
deadline; no queue holds anything after the end; every page comes back; every greedy or seeded
request that finished equals a depth-1 engine's answer (without faults; both engines batch-invariant,
so the comparison is exact); every output's text equals its token ids' text (decoded afresh, less a
final stop token, cut at a stop string); no class of requests (text, each grammar field, with
images, each skill) fails wholly; RSS stays within 64 MB of the first round's (read after gc and
glibc's malloc_trim: freed memory the allocator keeps is not a leak; both figures are printed).
--no-batch-invariant soaks the default (fast) CPU path, the memory rule included; there a near-tie
may differ from depth 1, so differences are reported, not failures (issue 37). --output-stage / --slow-detok-ms / --switch-interval soak the
threaded output stage (the reference engine keeps the loop stage): a detokeniser that sleeps per
call, and the interpreter switching threads every microsecond. --shared-prefixes starts half the
requests with one of four long common prefixes (some with a cache salt), so the soaked engine's
prefix cache hits, evicts and shares pages under all of the above; the depth-1 reference engine
runs with prefix caching off, so a wrong cached page shows as a mismatch.

    python tools/soak/soak.py --requests 10000 --rounds 2 --shared-prefixes --seed 3   # issue 29 (caching is on)

--images serves the tiny random Idefics3 (tests/idefics3_fixture.py, built into a temporary folder)
instead, and gives a share of requests 1-3 images from a pool of six pictures (repeats hit the
encoder cache, which is kept small: 40 rows, so it evicts); encoder-cache references and entries
left after each round are reported beside pages (leaked encoder entries: references still held, or
outputs the runner holds that the cache forgot).

    python tools/soak/soak.py --requests 2000 --rounds 2 --images   # issue 30
    python tools/soak/soak.py --requests 5000 --rounds 2 --images --shared-prefixes --seed 5   # issue 36: with
                                                           # --images, shared prefixes start token prompts only

--skills mixes the spatial skills in (issue 31): a share of requests are `point` / `detect` calls
(greedy, 1-4 objects, one picture of the pool with --images), some cancelled (the awaiting task,
or leaving `stream_skill` early); each finished one's result dict must equal the depth-1 engine's.

    python tools/soak/soak.py --requests 2000 --rounds 2 --images --skills --seed 3   # issue 31

--skills-model moondream serves the tiny random Moondream folder (tests/moondream_fixture.py)
instead: point/detect decode their values with the region heads (carried on the device), and every
other request is a question about exactly one picture (Moondream's query: one image, no marker).

    python tools/soak/soak.py --requests 2000 --rounds 2 --skills --skills-model moondream --seed 3
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import os
import random
import sys
from pathlib import Path
import time
from collections import Counter
from dataclasses import dataclass, field

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout, not an installed one

import msgspec

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.errors import InvalidRequestError, SlipstreamError
from slipstream.faults import FaultInjector, install

FAULT_RATES = {"forward": 0.002, "sample": 0.002, "matcher": 0.02, "detokenize": 0.001}
STOP_IDS = [0.15, 4]  # share of requests with stop_token_ids, and how many (--stop-ids)
SHARED: list[list[int]] = []  # --shared-prefixes: the common prefixes (empty: none)
SHARED_RATE = 0.5
VOCAB = [3, 259]  # token ids drawn for prompts and stop ids (--images: the tiny Idefics3's characters)
IMAGES: list = []  # --images: the picture pool (empty: text only)
IMAGE_RATE = 0.3
SKILLS: list[str] = []  # --skills: the skill kinds mixed in (empty: none)
SKILL_RATE = 0.2
SKILL_OBJECTS = ["cat", "dog", "box", "person", "red car"]
MODEL = ["tiny-random"]
ONE_IMAGE = [False]  # --skills-model moondream: every request asks about exactly one picture
SKILL_RID: contextvars.ContextVar[str | None] = contextvars.ContextVar("soak_skill_rid", default=None)
SKILL_SEQS: dict[str, str] = {}  # engine request id of a skill's sequence -> its planned rid


@dataclass
class Planned:
    rid: str
    prompt: list[int]
    params: SamplingParams
    delay: float  # seconds after the round starts
    cancel: str | None = None  # "task" | "stream" | "abort"
    cancel_after: float = 0.0  # seconds (task / abort) or deltas (stream)
    compare: bool = False  # greedy or seeded: must equal depth 1 when it finishes
    images: list = field(default_factory=list)
    bad: str | None = None  # an outside-probe input (issue 27): must be refused with InvalidRequestError
    skill: tuple[str, str, int] | None = None  # --skills: (kind, object, max_objects); the result is its dict


@dataclass
class Report:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)  # ok / abort / cancelled / typed error names
    lost: int = 0  # no outcome before the deadline
    bad: int = 0  # outside-probe inputs sent
    bad_accepted: list[str] = field(default_factory=list)  # bad inputs not refused with InvalidRequestError
    duplicated: int = 0  # something arrived after the terminal item
    untyped: list[str] = field(default_factory=list)  # exceptions that are not SlipstreamError
    leaked_pages: int = 0
    leaked_encoder_entries: int = 0  # encoder-cache references held, or runner outputs the cache forgot, after a round
    encoder_hits: int = 0
    encoder_misses: int = 0
    compared: int = 0
    skills: int = 0  # --skills: skill requests sent
    skills_compared: int = 0  # of them, result dicts compared with depth 1 (counted in `compared` too)
    mismatches: list[str] = field(default_factory=list)
    texts_checked: int = 0
    stop_token_ended: int = 0  # of them, outputs ended by a stop token (its text must not show)
    text_mismatches: list[str] = field(default_factory=list)  # text != its token ids' text
    preemptions: int = 0
    failed_steps: int = 0
    cache_hits: int = 0  # prompt tokens served from the prefix cache (of cache_queries looked up)
    cache_queries: int = 0
    cache_evictions: int = 0
    faults: Counter = field(default_factory=Counter)
    rss_mb: list[float] = field(default_factory=list)  # after gc and returning the allocator's free memory
    rss_untrimmed_mb: list[float] = field(default_factory=list)  # the same moment, before that
    classes: dict = field(default_factory=dict)  # request class -> Counter of outcomes (request_class)
    exact: bool = True  # batch-invariant engines: a mismatch with depth 1 is a failure
    seconds: float = 0.0

    @property
    def rss_growth_mb(self) -> float:
        """After the first round (which allocates what the engine keeps): should stay near 0."""
        return self.rss_mb[-1] - self.rss_mb[0] if len(self.rss_mb) > 1 else 0.0

    @property
    def failed_classes(self) -> dict[str, Counter]:
        """Classes of requests (MIN_CLASS or more, not cancelled) of which none succeeded: a whole kind
        of request failing is a defect, not expected errors (issue 37: every grammar on one model)."""
        return {name: c for name, c in self.classes.items()
                if sum(c.values()) - c["cancelled"] >= MIN_CLASS and not sum(c[k] for k in SUCCESS)}

    @property
    def ok(self) -> bool:
        return not (self.lost or self.bad_accepted or self.duplicated or self.untyped or self.leaked_pages
                    or self.leaked_encoder_entries or self.failed_classes
                    or (self.mismatches and self.exact) or self.text_mismatches
                    or self.rss_growth_mb > 64 or self.outcomes["EngineClosedError"])  # the engine must go on


SUCCESS = ("ok", "ok-stream", "ok-skill", "abort")  # (abort: engine.abort answered, the request ran)
MIN_CLASS = 10


def request_class(p: "Planned") -> str:
    """What kind of request `p` is, for the no-class-fails-wholly rule."""
    if p.skill is not None:
        return f"skill {p.skill[0]}" + (" with image" if p.images else "")
    kind = p.params.grammar_field() or "text"
    return kind + (" with images" if p.images else "")


def engine_config(depth: int, output_stage: str = "loop", prefix_caching: bool = False,
                  batch_invariant: bool = True) -> EngineConfig:
    # batch_invariant: the comparison with depth 1 is exact only if a row's logits do not depend on
    # what shares its step (tests/invariance.py). Without it, a seeded row whose top-p boundary sits
    # within an ulp of a token's cumulative mass samples another token in another batch.
    return EngineConfig(model=MODEL[0], pipeline_depth=depth, max_batch_size=16, max_num_batched_tokens=64,
                        kv_cache_tokens=512, page_size=8, seed=7, output_stage=output_stage,
                        max_prompt_chars=MAX_PROMPT_CHARS, prefix_caching=prefix_caching,
                        batch_invariant=batch_invariant, encoder_cache_tokens=40, max_encoder_tokens_per_step=24)


def use_images(seed: int) -> None:
    """--images: the tiny Idefics3 folder and a pool of pictures of various sizes."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from idefics3_fixture import SPECIAL_TOKENS, tiny_idefics3_folder

    MODEL[0] = str(tiny_idefics3_folder(Path(tempfile.mkdtemp(prefix="soak-idefics3-"))))
    VOCAB[:] = [len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + 95]  # printable characters: no image token
    IMAGES[:] = _picture_pool(seed, ((64, 64), (100, 150), (40, 30), (300, 90), (64, 64), (128, 128)))


def use_moondream(seed: int) -> None:
    """--skills-model moondream: the tiny Moondream folder; its requests each take one picture."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from moondream_fixture import tiny_moondream_folder

    MODEL[0] = str(tiny_moondream_folder(Path(tempfile.mkdtemp(prefix="soak-moondream-")) / "moondream-tiny"))
    VOCAB[:] = [1, 96]  # the byte-level characters (0 is <|endoftext|>)
    ONE_IMAGE[0] = True
    IMAGES[:] = _picture_pool(seed, ((60, 40), (30, 30), (44, 52), (100, 60), (28, 28), (64, 64)))


def _picture_pool(seed: int, sizes) -> list:
    """Random RGB pictures of these (width, height) sizes, from one seeded stream."""
    import numpy as np
    from PIL import Image

    rs = np.random.RandomState(seed)
    return [Image.fromarray(rs.randint(0, 256, (h, w, 3), dtype=np.uint8), "RGB") for w, h in sizes]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def shared_prefixes(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed + 1)
    return [_ids(rng, rng.randint(40, 120)) for _ in range(n)]


MAX_PROMPT_CHARS = 4096
BAD_RATE = 0.02
# values forced into a checked SamplingParams behind its back (it is frozen; msgspec's force_setattr
# is the one way left): the Engine checks again at submission
FORCED = [("max_tokens", 0), ("temperature", float("nan")), ("top_p", 0.0), ("n", 0), ("top_logprobs", 10_000),
          ("stop", ["ok", 1]), ("min_p", 2.0), ("seed", -1), ("stop_token_ids", [-1]), ("logprobs", "yes")]


def bad_request(rng: random.Random, rid: str, delay: float) -> Planned:
    """An input an outside probe sent (issue 27, defects 5, 7, 8)."""
    kind = rng.choice(["forced", "huge_prompt", "deep_schema"])
    prompt: list[int] | str = _ids(rng, rng.randint(1, 12))
    params = SamplingParams(max_tokens=rng.randint(1, 8))
    if kind == "forced":
        field_, value = rng.choice(FORCED)
        msgspec.structs.force_setattr(params, field_, value)
        kind = f"forced {field_}={value!r}"
    elif kind == "huge_prompt":
        prompt = "x" * (MAX_PROMPT_CHARS + rng.randint(1, 100_000))
    else:
        schema: dict = {"type": "string"}
        for _ in range(1500):
            schema = {"type": "array", "items": schema}
        params = SamplingParams(max_tokens=4, json_schema=schema)
    return Planned(rid, prompt, params, delay, bad=kind)


def plan_round(rng: random.Random, n: int, round_no: int) -> list[Planned]:
    out, t = [], 0.0
    burst_at = set(rng.sample(range(n), k=max(1, n // 1000))) if n >= 200 else set()
    i = 0
    while i < n:
        if i in burst_at:  # a burst: up to 200 requests at the same instant
            size = min(200, n - i)
        else:
            size = 1
            t += rng.expovariate(400.0)
        for _ in range(size):
            out.append(random_request(rng, f"r{round_no}-{i}", t))
            i += 1
    return out


def plan_skill(rng: random.Random, rid: str, delay: float) -> Planned:
    """A point/detect call on one picture of the pool (none without --images); greedy, so comparable."""
    skill = (rng.choice(SKILLS), rng.choice(SKILL_OBJECTS), rng.randint(1, 4))
    images = [rng.choice(IMAGES)] if IMAGES else []
    cancel = rng.choice(["task", "stream"]) if rng.random() < 0.15 else None
    after = rng.uniform(0, 0.05) if cancel == "task" else rng.randint(0, 2)  # seconds / objects read
    return Planned(rid, "", SamplingParams(), delay, cancel, after, compare=True, images=images, skill=skill)


def random_request(rng: random.Random, rid: str, delay: float) -> Planned:
    if rng.random() < BAD_RATE:
        return bad_request(rng, rid, delay)
    if SKILLS and rng.random() < SKILL_RATE:
        return plan_skill(rng, rid, delay)
    prompt: list[int] | str = _ids(rng, rng.choice([rng.randint(1, 12), rng.randint(10, 90)]))
    kw: dict = dict(max_tokens=rng.randint(1, 24))
    images = []
    if ONE_IMAGE[0]:  # Moondream's query: one picture, the question as text (the template is the model's)
        images = [rng.choice(IMAGES)]
        prompt = " ".join("".join(chr(rng.randrange(97, 123)) for _ in range(rng.randint(1, 8)))
                          for _ in range(rng.randint(1, 6))) + "?"
    elif IMAGES and rng.random() < IMAGE_RATE:  # text with <image> markers (tokenised with the images)
        images = [rng.choice(IMAGES) for _ in range(rng.randint(1, 3))]
        words = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randint(1, 20)))
        prompt = "".join(f"<image>{words}{i}" for i in range(len(images))) + "?"
    if SHARED and isinstance(prompt, list) and rng.random() < SHARED_RATE:  # (text with images: none)
        prompt = rng.choice(SHARED) + prompt[:rng.randint(0, 24)]
        if rng.random() < 0.2:
            kw["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
        elif rng.random() < 0.05:
            kw["prefix_caching"] = False
    kind = rng.random()
    if kind < 0.55:
        kw["temperature"] = 0.0
    elif kind < 0.8:
        kw.update(temperature=0.9, top_p=0.9, top_k=rng.choice([0, 40]), seed=rng.randrange(2**31))
    else:
        kw.update(temperature=1.0)  # unseeded: not comparable, still must end cleanly
    if rng.random() < 0.15:
        kw["stop"] = [chr(rng.randrange(97, 123)) for _ in range(rng.randint(1, 2))]
    if rng.random() < STOP_IDS[0]:
        kw["stop_token_ids"] = _ids(rng, STOP_IDS[1])
    if rng.random() < 0.1:
        kw["ignore_eos"] = True
    if rng.random() < 0.06:
        kw.pop("stop", None)
        if rng.random() < 0.5:
            kw["regex"] = "[a-z]{1,6}( [a-z]{1,6})?"
        else:
            kw["choice"] = ["yes", "no", "maybe"]
    params = SamplingParams(**kw)
    compare = params.temperature == 0.0 or params.seed is not None
    cancel = None
    if rng.random() < 0.15:
        cancel = rng.choice(["task", "stream", "abort"])
    return Planned(rid, prompt, params, delay, cancel, rng.uniform(0, 0.05) if cancel != "stream" else rng.randint(0, 4),
                   compare, images=images)


async def run_one(engine: Engine, p: Planned, t0: float, deadline_s: float, report: Report, results: dict) -> None:
    await asyncio.sleep(max(0.0, t0 + p.delay - time.perf_counter()))
    started = time.perf_counter()
    try:
        await asyncio.wait_for(_drive(engine, p, results), deadline_s)
    except TimeoutError:
        pass
    if time.perf_counter() - started >= deadline_s:  # (_drive may have turned the deadline's cancel into
        results.pop(p.rid, None)                     # a "cancelled" outcome): counted once, as lost


async def _drive(engine: Engine, p: Planned, results: dict) -> None:
    if p.skill is not None:
        return await _drive_skill(engine, p, results)
    try:
        if p.cancel == "stream":
            deltas = 0
            stream = engine.stream(p.prompt, p.params, request_id=p.rid, images=p.images)
            async for _ in stream:
                deltas += 1
                if deltas > p.cancel_after:
                    break
            results[p.rid] = "cancelled" if deltas > p.cancel_after else "ok-stream"
            return
        task = asyncio.ensure_future(engine.complete(p.prompt, p.params, request_id=p.rid, images=p.images))
        if p.cancel == "task":
            done, _ = await asyncio.wait([task], timeout=p.cancel_after)
            if not done:
                task.cancel()
        elif p.cancel == "abort":
            await asyncio.sleep(p.cancel_after)
            await engine.abort(p.rid)
        results[p.rid] = await task
    except asyncio.CancelledError:
        results[p.rid] = "cancelled"
    except SlipstreamError as e:
        results[p.rid] = e
    except Exception as e:  # noqa: BLE001 - an untyped error is what the soak looks for
        results[p.rid] = e


def _skill_call(engine: Engine, p: Planned):
    kind, obj, n = p.skill
    return getattr(engine, kind)(p.prompt, obj, n, images=p.images)


async def _drive_skill(engine: Engine, p: Planned, results: dict) -> None:
    """A skill has no request id to abort by: it is cancelled as a caller would, by its task or by
    leaving its stream (whose close aborts the request). Its sequence is told by SKILL_RID."""
    SKILL_RID.set(p.rid)  # (this task's context: the tasks it creates inherit it)
    try:
        if p.cancel == "stream":
            kind, obj, n = p.skill
            read = 0
            stream = engine.stream_skill(kind, p.prompt, obj, n, images=p.images)
            try:
                async for _ in stream:
                    read += 1
                    if read > p.cancel_after:
                        break
            finally:
                await stream.aclose()
            results[p.rid] = "cancelled" if read > p.cancel_after else "ok-stream"
            return
        task = asyncio.ensure_future(_skill_call(engine, p))
        if p.cancel == "task":
            done, _ = await asyncio.wait([task], timeout=p.cancel_after)
            if not done:
                task.cancel()
        results[p.rid] = await task
    except asyncio.CancelledError:
        results[p.rid] = "cancelled"
    except Exception as e:  # noqa: BLE001 - typed or not, _count sorts it
        results[p.rid] = e


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def trimmed_rss_mb() -> tuple[float, float]:
    """(RSS, RSS after gc and glibc's malloc_trim). The memory rule reads the second: glibc keeps
    freed blocks (image decodes and preprocessing on worker threads: ~150 MB after a round of the
    image soak, returned by a trim), which is no leak; what is still allocated stays counted."""
    import ctypes
    import gc

    before = rss_mb()
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to return
        pass
    return before, rss_mb()


async def soak(requests: int, rounds: int = 3, seed: int = 0, rates: dict | None = None,
               deadline_s: float = 120.0, log=print, armed: dict[str, int] | None = None,
               output_stage: str = "loop", slow_detok_s: float = 0.0, prefix_caching: bool = True,
               batch_invariant: bool = True) -> Report:
    """`armed`: faults that fire for sure at their point's next checks (random rates may not fire
    in a short run: how many checks happen depends on timing). `slow_detok_s`: each detokeniser
    call of the soaked engine sleeps that long first (the GIL released, as a slow tokenizer might)."""
    rng = random.Random(seed)
    report = Report(requests=requests, exact=batch_invariant)
    started = time.perf_counter()
    faults = FaultInjector(FAULT_RATES if rates is None else rates, seed=seed)
    for point, times in (armed or {}).items():
        faults.arm(point, times)
    # the depth-1 reference engine lives beside the soaked one, so each round is checked and then
    # dropped: RSS measures the engine, not results kept by this tool
    async with (Engine(engine_config(2, output_stage, prefix_caching, batch_invariant)) as engine,
                Engine(engine_config(1, prefix_caching=False, batch_invariant=batch_invariant)) as reference):
        install(engine, faults)
        submitted = _record_submissions(engine, slow_detok_s)
        per_round = -(-requests // rounds)
        for r in range(rounds):
            batch = plan_round(rng, min(per_round, requests - r * per_round), r)
            results: dict[str, object] = {}
            t0 = time.perf_counter()
            await asyncio.gather(*(run_one(engine, p, t0, deadline_s, report, results) for p in batch))
            stats = await _settle(engine)
            report.leaked_pages = max(report.leaked_pages, stats["kv_pages_total"] - stats["kv_pages_free"])
            report.leaked_encoder_entries = max(report.leaked_encoder_entries, encoder_leaks(engine))
            _check_texts(engine, submitted, report)
            report.duplicated += _duplicates(engine, submitted, results)
            _count(batch, results, report)
            await _compare_with_depth1(reference, batch, results, report)
            del results, batch
            untrimmed, trimmed = trimmed_rss_mb()
            report.rss_untrimmed_mb.append(round(untrimmed, 1))
            report.rss_mb.append(round(trimmed, 1))
            log(f"round {r + 1}/{rounds}: {stats['preemptions']} preemptions so far, {stats['failed_steps']} failed "
                f"steps, {len(report.mismatches)} mismatches, rss {report.rss_mb[-1]} MB "
                f"({report.rss_untrimmed_mb[-1]} MB before the trim)")
        report.preemptions, report.failed_steps = stats["preemptions"], stats["failed_steps"]
        report.encoder_hits, report.encoder_misses = stats["encoder_cache_hits"], stats["encoder_cache_misses"]
        cache = engine.loop.planner.prefix_cache
        if cache is not None:
            c = cache.stats()
            report.cache_hits, report.cache_queries, report.cache_evictions = c.hits, c.queries, c.evictions
    report.faults = faults.fired
    report.seconds = time.perf_counter() - started
    return report


def encoder_leaks(engine: Engine) -> int:
    """Once settled: encoder-cache entries still referenced, plus encoder outputs the runner holds
    that the cache no longer knows (dropped ones included once the next launch drops them)."""
    cache, runner = engine.loop.planner.encoder_cache, engine._parts.runner
    held = sum(e.refs > 0 for e in cache._entries.values())
    pending = set(cache.dropped)
    return held + len(set(runner.images.features) - pending - set(cache._entries))


def _count(batch: list[Planned], results: dict, report: Report) -> None:
    for p in batch:
        outcome = results.get(p.rid)
        if p.bad is None:
            report.classes.setdefault(request_class(p), Counter())[_outcome_name(outcome)] += 1
        report.bad += p.bad is not None
        report.skills += p.skill is not None
        if p.bad is not None and not isinstance(outcome, InvalidRequestError):
            report.bad_accepted.append(f"{p.rid} ({p.bad}): {outcome!r:.120}")
        if outcome is None:
            report.lost += 1  # (already counted if its deadline passed)
        elif isinstance(outcome, SlipstreamError):
            report.outcomes[type(outcome).__name__] += 1
        elif isinstance(outcome, BaseException):
            report.untyped.append(f"{p.rid}: {outcome!r}")
        elif isinstance(outcome, str):
            report.outcomes[outcome] += 1
        elif isinstance(outcome, dict):
            report.outcomes["ok-skill"] += 1
        else:
            report.outcomes["ok" if outcome.finish_reason != "abort" else "abort"] += 1


def _outcome_name(outcome) -> str:
    if isinstance(outcome, BaseException):
        return type(outcome).__name__
    if isinstance(outcome, str):
        return outcome
    if isinstance(outcome, dict):
        return "ok-skill"
    if outcome is None:
        return "lost"
    return "ok" if outcome.finish_reason != "abort" else "abort"


async def _settle(engine: Engine, timeout: float = 30.0) -> dict:
    deadline = time.perf_counter() + timeout
    while True:
        s = await engine.stats()
        if (s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0 and s["waiting"] == 0
                and s["inflight_steps"] == 0) or time.perf_counter() > deadline:
            return s
        await asyncio.sleep(0.01)


class _SlowDetok:
    def __init__(self, inner, seconds: float):
        self.inner, self.seconds = inner, seconds

    def push(self, ids):
        time.sleep(self.seconds)
        return self.inner.push(ids)

    def flush(self):
        return self.inner.flush()


def _record_submissions(engine: Engine, slow_detok_s: float = 0.0) -> list:
    """Keep every submitted sequence, to look into its result queue once the round is over."""
    seqs, submit = [], engine.submitter.submit

    async def recording(*args, **kwargs):
        seq = await submit(*args, **kwargs)
        if (rid := SKILL_RID.get()) is not None:
            SKILL_SEQS[seq.request_id] = rid
        if slow_detok_s:  # (no token is committed before this: the submission does not yield)
            seq.user.detok = _SlowDetok(seq.user.detok, slow_detok_s)
        seqs.append(seq)
        return seq

    engine.submitter.submit = recording  # type: ignore[method-assign]
    return seqs


def _check_texts(engine: Engine, seqs: list, report: Report) -> None:
    """Every output's text against its token ids decoded afresh: less a final stop token (its text
    is not output), cut at the first stop string."""
    from slipstream.models.tokenizers.byte_stream import make_detokenizer

    for q in seqs:
        req, out = q.user, q.user.output
        if out is None:
            continue
        ids = list(out.token_ids)
        if out.finish_reason == "stop" and ids and ids[-1] in req.stop_token_ids:
            ids.pop()
            report.stop_token_ended += 1
        detok = make_detokenizer(engine.tokenizer, req.prompt_ids)
        want = detok.push(ids) + detok.flush()
        cuts = [i for i in (want.find(s) for s in req.params.stop) if i >= 0]
        if cuts:
            want = want[:min(cuts)]
        report.texts_checked += 1
        if out.text != want:
            report.text_mismatches.append(f"{q.request_id}: text {out.text!r}, its tokens' text {want!r} "
                                          f"({out.finish_reason}, ids {out.token_ids})")


def _duplicates(engine: Engine, seqs: list, results: dict) -> int:
    """Requests that ended more than once (two terminal items: results or errors), or not at all,
    or are still registered after their callers left. A cancelled caller read no terminal item."""
    from slipstream.outputs import CompletionOutput

    bad = len(engine.submitter.requests)
    for q in seqs:
        left = sum(isinstance(item, (CompletionOutput, BaseException)) for item in q.user.queue.pending())
        read = 0 if results.get(SKILL_SEQS.pop(q.request_id, q.request_id)) == "cancelled" else 1
        bad += (left + read != 1 and not (read == 0 and left == 0)) or not q.finished
    seqs.clear()
    return bad


async def _compare_with_depth1(reference: Engine, batch: list[Planned], results: dict, report: Report) -> None:
    skills = [(p, results[p.rid]) for p in batch if p.skill is not None and isinstance(results.get(p.rid), dict)]
    refs = await asyncio.gather(*(_skill_call(reference, p) for p, _ in skills))
    for (p, got), want in zip(skills, refs):
        report.compared += 1
        report.skills_compared += 1
        if got != want:
            report.mismatches.append(f"{p.rid} ({p.skill[0]}): depth 2 {got} vs depth 1 {want}")
    todo = [(p, results[p.rid]) for p in batch if p.compare and hasattr(results.get(p.rid), "finish_reason")
            and results[p.rid].finish_reason != "abort"]
    refs = await asyncio.gather(*(reference.complete(p.prompt, p.params, images=p.images) for p, _ in todo))
    for (p, got), want in zip(todo, refs):
        report.compared += 1
        if (got.token_ids, got.text, got.finish_reason) != (want.token_ids, want.text, want.finish_reason):
            report.mismatches.append(f"{p.rid}: depth 2 {got.token_ids} {got.finish_reason} vs depth 1 "
                                     f"{want.token_ids} {want.finish_reason}")


def format_report(r: Report) -> str:
    lines = [
        f"requests {r.requests} in {r.seconds:.1f} s",
        f"outcomes {dict(sorted(r.outcomes.items()))}",
        f"lost {r.lost}  duplicated {r.duplicated}  untyped errors {len(r.untyped)}  leaked pages {r.leaked_pages}"
        f"  leaked encoder entries {r.leaked_encoder_entries}",
        f"outside-probe inputs {r.bad}, not refused with InvalidRequestError {len(r.bad_accepted)}",
        f"greedy/seeded compared with depth 1: {r.compared}, mismatches {len(r.mismatches)}"
        + ("" if r.exact else " (not batch-invariant: reported, not a failure)"),
        f"skill requests (point/detect) {r.skills}, result dicts compared with depth 1: {r.skills_compared}",
        f"texts checked against their token ids: {r.texts_checked} ({r.stop_token_ended} ended by a stop token), "
        f"differing {len(r.text_mismatches)}",
        f"preemptions {r.preemptions}  failed steps {r.failed_steps}  faults fired {dict(sorted(r.faults.items()))}",
        f"prefix cache: {r.cache_hits} of {r.cache_queries} tokens looked up were hits, "
        f"{r.cache_evictions} evictions",
        f"encoder cache: {r.encoder_hits} hits, {r.encoder_misses} misses (encoder runs)",
        f"rss per round (MB, after gc and malloc_trim) {r.rss_mb}  growth after round 1: {r.rss_growth_mb:+.1f} MB"
        f" (rule: 64); before the trim {r.rss_untrimmed_mb}",
        "request classes (succeeded / sent): " + ", ".join(
            f"{name} {sum(c[k] for k in SUCCESS)}/{sum(c.values())}" for name, c in sorted(r.classes.items())),
        "PASS" if r.ok else "FAIL",
    ]
    lines += [f"  class {name}: 0 of {sum(c.values()) - c['cancelled']} succeeded: {dict(c)}"
              for name, c in r.failed_classes.items()]
    lines += [f"  bad input accepted: {b}" for b in r.bad_accepted[:10]]
    lines += [f"  untyped: {u}" for u in r.untyped[:10]] + [f"  mismatch: {m}" for m in r.mismatches[:10]]
    lines += [f"  text: {t}" for t in r.text_mismatches[:10]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--output-stage", default="loop", choices=["loop", "thread"],
                    help="the soaked engine's EngineConfig.output_stage")
    ap.add_argument("--slow-detok-ms", type=float, default=0.0, help="sleep per detokeniser call (soaked engine)")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s): shake the GIL")
    ap.add_argument("--stop-ids", type=float, nargs=2, default=STOP_IDS, metavar=("SHARE", "COUNT"),
                    help="share of requests given stop_token_ids, and how many (more requests end by a stop token)")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="the soaked engine caches prefixes (on, as the engine's default; the depth-1 reference never does)")
    ap.add_argument("--shared-prefixes", action="store_true",
                    help=f"a share ({SHARED_RATE}) of requests start with one of four long common prefixes")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="both engines batch-invariant (the default: what makes the depth-1 comparison exact); "
                         "--no-batch-invariant soaks the fast CPU path, where a near-tie may differ")
    ap.add_argument("--images", action="store_true",
                    help=f"serve the tiny Idefics3; a share ({IMAGE_RATE}) of requests carry 1-3 images")
    ap.add_argument("--skills", action="store_true",
                    help=f"a share ({SKILL_RATE}) of requests are point/detect calls (with an image under --images)")
    ap.add_argument("--skills-model", choices=["idefics3", "moondream"], default=None,
                    help="moondream: serve the tiny Moondream (region heads; every request has one picture); "
                         "idefics3: as --images")
    args = ap.parse_args()
    if args.skills_model == "moondream":
        use_moondream(args.seed)
    elif args.images or args.skills_model == "idefics3":
        use_images(args.seed)
    if args.skills:
        SKILLS[:] = ["point", "detect"]
    STOP_IDS[:] = args.stop_ids[0], int(args.stop_ids[1])
    if args.shared_prefixes:
        SHARED[:] = shared_prefixes(args.seed)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    import uvloop

    from slipstream.logging_setup import configure_logging

    configure_logging("error")  # injected faults log errors by design; the report says what matters
    from slipstream.provenance import header, provenance

    print(header(provenance()), flush=True)  # command, commit (dirty?), versions, date, machine load
    report = uvloop.run(soak(args.requests, args.rounds, args.seed, {} if args.no_faults else None,
                             output_stage=args.output_stage, slow_detok_s=args.slow_detok_ms / 1e3,
                             prefix_caching=args.prefix_caching, batch_invariant=args.batch_invariant))
    print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
