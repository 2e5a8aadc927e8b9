"""Prometheus metrics: an in-process registry per engine, and a text endpoint for worker mode.

Every series carries a `model` label (EngineConfig.model). Series (seconds unless named otherwise):
  slipstream_requests_finished_total{finish_reason}  requests finished: stop | length | abort
  slipstream_prompt_tokens_total          prompt tokens of requests that got their first token
  slipstream_generation_tokens_total      output tokens (counted as the output stage processes them)
  slipstream_ttft_seconds                 arrival → first token committed, per request
  slipstream_inter_token_latency_seconds  between consecutive committed tokens of a request
  slipstream_step_period_seconds          start of step k → start of step k+1 (device spans when
                                          tracing is on, else host launch → next launch)
  slipstream_device_idle_seconds          the bubble per step (tracing only; the worker traces by default)
  slipstream_forward_seconds              forward device time per step (tracing only, as above)
  slipstream_bookkeeping_seconds          host plan + launch + commit + finalize per step
  slipstream_steps_total                  committed steps
  slipstream_eager_steps_total            steps launched without a graph (every step on the CPU, which has
                                          none; on CUDA 0 in steady serving once the graphs are captured)
  slipstream_queue_depth                  requests waiting for admission
  slipstream_running_sequences            admitted, unfinished sequences
  slipstream_kv_pages_free / _used / _total, slipstream_kv_cache_usage_ratio (used / total)
  slipstream_prefix_cache_queries_total   prompt tokens looked up in the prefix cache at admission
  slipstream_prefix_cache_hits_total      of those, tokens served from cached pages (not computed)
  slipstream_prefix_cache_hit_rate        hits / queries since the start (0 before any query)
  slipstream_prefix_cache_cached_pages    pages registered in the cache (in use or hittable in its LRU)
  slipstream_prefix_cache_evictions_total cached pages the pool took back for new work
  (the five prefix_cache series exist only while EngineConfig.prefix_caching is on, the default; docs/prefix-caching.md)
  slipstream_encoder_cache_hits_total     images of admitted requests whose encoder output was held
  slipstream_encoder_cache_misses_total   images whose encoder ran (one per entry made)
  slipstream_encoder_cache_entries        images whose encoder output is held (in use or evictable)
  slipstream_encoder_cache_bytes          bytes of those outputs (rows x hidden x dtype size)
  slipstream_encoder_cache_evictions_total outputs dropped to stay within encoder_cache_tokens
  (the encoder_cache series exist only for a model that takes images; docs/images.md)
Throughput is a rate of the counters, e.g. rate(slipstream_generation_tokens_total[1m]).
Periods that span an idle engine (nothing to run) are not observed: they are not steps.

Cost: at depth 1 anything the loop does after a commit is device idle, so the tick only appends a
few numbers per step to queues (about 0.1 µs each); per-token figures (TTFT, ITL, token counts) are
queued by the output stage, off the tick, in one call per pass (`on_pass`). Queues are folded into the histograms (one vectorised
bucket count per fold) and counters when the registry is collected (a scrape, `text()`), on the
scraper's thread, or by the loop once a queue gets long. Gauges are read at scrape time, and so
are the prefix cache's series (from `planner.prefix_cache.stats()`: nothing on the tick).
"""
from __future__ import annotations

import operator
from collections import deque
from typing import Any

import numpy as np

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_STEP = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)
_IDLE = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3)
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_FOLD_AT = 8192  # values queued before the loop folds them itself (no scraper: memory stays bounded)


class _Deferred:
    """A histogram fed through a queue: append on the loop, observe at collection."""

    __slots__ = ("hist", "queue")

    def __init__(self, hist: Histogram):
        self.hist, self.queue = hist, deque[float]()

    def fold(self) -> None:
        q, values = self.queue, []
        while q:  # deque append/popleft are thread-safe: the loop and a scraper may both be here
            try:
                values.append(q.popleft())
            except IndexError:
                break
        if values:
            _observe_many(self.hist, values)


def _observe_many(hist, values: list[float]) -> None:
    """Histogram.observe for many values at once: one vectorised bucket count instead of a Python
    call per value (prometheus_client's observe costs ~2 µs; a loop at 512 streams folds thousands
    of values per step). Falls back to observe() if the client's internals ever differ."""
    bounds = getattr(hist, "_upper_bounds", None)
    buckets, total = getattr(hist, "_buckets", None), getattr(hist, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            hist.observe(v)
        return
    arr = np.asarray(values, dtype=np.float64)
    counts = np.bincount(np.searchsorted(np.asarray(bounds, dtype=np.float64), arr, side="left"),
                         minlength=len(bounds))
    for bucket, c in zip(buckets, counts.tolist()):
        if c:
            bucket.inc(c)
    total.inc(float(arr.sum()))


class _DeferredCount:
    """A counter fed through a queue of increments, like _Deferred."""

    __slots__ = ("counter", "queue")

    def __init__(self, counter):
        self.counter, self.queue = counter, deque[int]()

    def fold(self) -> None:
        q, total = self.queue, 0
        while q:
            try:
                total += q.popleft()
            except IndexError:
                break
        if total:
            self.counter.inc(total)


class _Folder:
    """Registered first, so collecting the registry folds the queues before histograms are read."""

    def __init__(self):
        self.items: list[_Deferred | _DeferredCount] = []

    def collect(self):
        for d in self.items:
            d.fold()
        return []


class PrefixCacheCollector:
    """The prefix cache's counters as Prometheus series, read from its stats() at each collection
    (the scraper's thread: a snapshot of a few ints the loop updates)."""

    def __init__(self, cache, model: str):
        self.cache, self.model = cache, model

    def collect(self):
        st, labels = self.cache.stats(), [self.model]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=["model"])
            fam.add_metric(labels, value)
            return fam

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=["model"])
            fam.add_metric(labels, value)
            return fam

        yield counter("slipstream_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", st.queries)
        yield counter("slipstream_prefix_cache_hits", "Prompt tokens served from the prefix cache", st.hits)
        yield gauge("slipstream_prefix_cache_hit_rate", "Prefix cache hits / queries (tokens, since start)",
                    hit_rate(st))
        yield gauge("slipstream_prefix_cache_cached_pages", "KV pages registered in the prefix cache",
                    st.cached_pages)
        yield counter("slipstream_prefix_cache_evictions", "Cached KV pages reclaimed by the pool", st.evictions)


class EncoderCacheCollector:
    """The encoder cache's counters (scheduler/encoder_cache.py), read at each collection like the
    prefix cache's."""

    def __init__(self, cache, model: str, row_bytes: int):
        self.cache, self.model, self.row_bytes = cache, model, row_bytes

    def collect(self):
        st, labels = self.cache.stats(), [self.model]
        for kind, name, doc, value in (
                (CounterMetricFamily, "slipstream_encoder_cache_hits", "Images whose encoder output was held", st.hits),
                (CounterMetricFamily, "slipstream_encoder_cache_misses", "Images whose encoder ran", st.misses),
                (GaugeMetricFamily, "slipstream_encoder_cache_entries", "Encoder outputs held", st.entries),
                (GaugeMetricFamily, "slipstream_encoder_cache_bytes", "Bytes of encoder outputs held",
                 st.features * self.row_bytes),
                (CounterMetricFamily, "slipstream_encoder_cache_evictions", "Encoder outputs evicted", st.evictions)):
            fam = kind(name, doc, labels=["model"])
            fam.add_metric(labels, value)
            yield fam


def hit_rate(stats) -> float:
    """hits / queries of a PrefixCacheStats (tokens), 0.0 before any query."""
    return stats.hits / stats.queries if stats.queries else 0.0


class SpeculationCollector:
    """Speculative decoding's counts (`Speculation.stats`) as Prometheus series, read at each
    collection; registered only when `EngineConfig.speculative` is set."""

    def __init__(self, speculation, model: str):
        self.speculation, self.model = speculation, model

    def collect(self):
        st, labels = self.speculation.stats(), [self.model]
        for name, doc, value in (("slipstream_spec_drafts", "Drafted tokens fed to verification", st["drafted"]),
                                 ("slipstream_spec_accepted", "Drafted tokens accepted", st["accepted"]),
                                 ("slipstream_spec_steps", "Rows' steps that fed drafts", st["steps"])):
            fam = CounterMetricFamily(name, doc, labels=["model"])
            fam.add_metric(labels, value)
            yield fam
        for name, doc, value in (
                ("slipstream_spec_acceptance_rate", "Accepted / fed drafts, since start", st["acceptance_rate"]),
                ("slipstream_spec_mean_accepted_length", "Drafts accepted per row's step with drafts, since start",
                 st["mean_accepted_length"])):
            gauge = GaugeMetricFamily(name, doc, labels=["model"])
            gauge.add_metric(labels, value)
            yield gauge


class EagerStepsCollector:
    """The runner's count of steps launched without a graph, read at each collection."""

    def __init__(self, runner, model: str):
        self.runner, self.model, self.count = runner, model, 0

    def detach(self) -> None:
        """Keep the count, not the runner (a closed engine's registry may outlive it)."""
        if self.runner is not None:  # (a dead loop's parts may be closed twice)
            self.count, self.runner = self.runner.eager_steps, None

    def collect(self):
        fam = CounterMetricFamily("slipstream_eager_steps", "Steps launched without a graph", labels=["model"])
        fam.add_metric([self.model], self.count if self.runner is None else self.runner.eager_steps)
        yield fam


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model: str = ""):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.model = model
        self._folder = _Folder()
        r.register(self._folder)
        labels = ("model",)

        def hist(name: str, doc: str, buckets) -> _Deferred:
            d = _Deferred(Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model))
            self._folder.items.append(d)
            return d

        def count(name: str, doc: str) -> _DeferredCount:
            d = _DeferredCount(Counter(name, doc, labels, registry=r).labels(model))
            self._folder.items.append(d)
            return d

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model)

        self.step_period = hist("slipstream_step_period_seconds", "Step period: start of a step to the next", _STEP)
        self.device_idle = hist("slipstream_device_idle_seconds", "Device idle per step (the bubble)", _IDLE)
        self.forward = hist("slipstream_forward_seconds", "Forward device time per step", _STEP)
        self.bookkeeping = hist("slipstream_bookkeeping_seconds", "Host plan+launch+commit+finalize per step", _IDLE)
        self.ttft = hist("slipstream_ttft_seconds", "Time to first token", _TTFT)
        self.itl = hist("slipstream_inter_token_latency_seconds", "Time between consecutive tokens", _ITL)
        self.steps = count("slipstream_steps", "Committed steps")
        self.prompt_tokens = count("slipstream_prompt_tokens", "Prompt tokens of requests that got a first token")
        self.generation_tokens = count("slipstream_generation_tokens", "Output tokens committed")
        self._finished = Counter("slipstream_requests_finished", "Requests finished, by finish reason",
                                 ("model", "finish_reason"), registry=r)
        for reason in ("stop", "length", "abort"):  # present at 0 from the start: rates need a first sample
            self._finished.labels(model, reason)
        self.queue_depth = gauge("slipstream_queue_depth", "Requests waiting for admission")
        self.running = gauge("slipstream_running_sequences", "Admitted unfinished sequences")
        self.kv_pages_free = gauge("slipstream_kv_pages_free", "Free KV cache pages")
        self.kv_pages_used = gauge("slipstream_kv_pages_used", "KV cache pages held by sequences")
        self.kv_pages_total = gauge("slipstream_kv_pages_total", "KV cache pages sequences can use")
        self.kv_usage = gauge("slipstream_kv_cache_usage_ratio", "KV cache pages used / total (0..1)")
        self._loop: Any = None  # the EngineLoop it is attached to
        self._eager: EagerStepsCollector | None = None
        self._device_period = False
        self._last: tuple[float, int] | None = None  # (t_launch, idle_waits) of the previous commit
        self.muted = False  # True: nothing is observed (a worker's warm-up request is not traffic)

    def attach(self, loop, pool, tracer=None, encoder_row_bytes: int | None = None) -> "EngineMetrics":
        """`encoder_row_bytes`: the model takes images (its encoder cache's series are exported)."""
        self._loop = loop
        planner = loop.planner
        self.queue_depth.set_function(lambda: planner.num_waiting)
        self.running.set_function(lambda: sum(not s.finished for s in list(planner.running)))
        self.kv_pages_free.set_function(lambda: pool.num_free)
        self.kv_pages_used.set_function(lambda: pool.total - pool.num_free)
        self.kv_pages_total.set_function(lambda: pool.total)
        self.kv_usage.set_function(lambda: (pool.total - pool.num_free) / max(pool.total, 1))
        cache = getattr(planner, "prefix_cache", None)
        if cache is not None:
            self.registry.register(PrefixCacheCollector(cache, self.model))
        if getattr(planner, "speculation", None) is not None:
            self.registry.register(SpeculationCollector(planner.speculation, self.model))
        if hasattr(getattr(loop, "runner", None), "eager_steps"):  # (a real runner; the tests' fakes have none)
            self._eager = EagerStepsCollector(loop.runner, self.model)
            self.registry.register(self._eager)
        if encoder_row_bytes is not None:
            self.registry.register(EncoderCacheCollector(planner.encoder_cache, self.model, encoder_row_bytes))
        loop.observers.append(self.on_commit)
        loop.outputs.pass_observers.append(self.on_pass)
        loop.outputs.finish_observers.append(self.on_finish)
        if tracer is not None:  # device-measured period, idle and forward
            self._device_period = True
            tracer.listeners.append(self.on_step)
        return self

    def detach(self) -> None:
        """The engine closed: keep the series, not the loop (which holds the runner and KV cache)."""
        self._loop = None
        if self._eager is not None:
            self._eager.detach()

    def on_finish(self, reason: str) -> None:
        """Called once per request as its caller gets its end (OutputProcessor), with that reason."""
        if self.muted:
            return
        self._finished.labels(self.model, reason).inc()

    def on_commit(self, step) -> None:
        if self.muted:
            return
        tm = step.timings
        self.steps.queue.append(1)
        self.bookkeeping.queue.append(tm.get("plan", 0.0) + tm.get("launch", 0.0) + tm.get("commit", 0.0)
                                      + tm.get("finalize", 0.0))
        t_launch, waits = tm.get("t_launch", 0.0), self._loop.idle_waits
        if not self._device_period and self._last is not None and self._last[1] == waits:
            self.step_period.queue.append(t_launch - self._last[0])
        self._last = (t_launch, waits)
        if len(self.itl.queue) > _FOLD_AT or len(self.bookkeeping.queue) > _FOLD_AT:
            self._folder.collect()

    def on_pass(self, ranges: list) -> None:
        """One output-stage pass (off the tick): each request's output tokens start..end were
        processed, as (RequestMetrics, start, end, prompt_len): TTFT at a request's first token,
        inter-token latencies between consecutive commits, the tokens counted once per pass."""
        if self.muted:
            return
        itl, sub, tokens = self.itl.queue, operator.sub, 0
        for m, start, end, prompt_len in ranges:
            if end <= start:
                continue
            tokens += end - start
            times = m.token_times
            if start == 0:
                self.ttft.queue.append(times[0] - m.arrival)
                self.prompt_tokens.queue.append(prompt_len)
                start = 1
            if end - start == 1:
                itl.append(times[start] - times[start - 1])
            elif end > start:
                itl.extend(map(sub, times[start:end], times[start - 1:end - 1]))
        if tokens:
            self.generation_tokens.queue.append(tokens)

    def on_step(self, rec) -> None:
        if rec.contiguous and not self.muted:
            self.step_period.queue.append(rec.period)
            self.device_idle.queue.append(rec.idle)
            self.forward.queue.append(rec.forward)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 9400):
    """Serve the Prometheus text format on http://host:port/metrics from a daemon thread.

    Returns (server, thread); `server.shutdown()` stops it. port 0 picks a free port
    (`server.server_port`)."""
    return start_http_server(port, addr=host, registry=registry)
