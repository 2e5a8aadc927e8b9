"""`slipstream worker`: one Engine served to many slipstream.Client over a ZMQ ROUTER socket.

Two threads. The socket thread (worker_io.WorkerIO) receives, decodes, validates, encodes and
sends. The asyncio thread runs the Engine and this dispatcher: one task per request, which feeds
Engine.stream/complete and queues outputs for the socket thread. The dispatcher tracks requests per
client, so a client's Bye or disconnect cancels its tasks, which aborts them in the Engine and
frees their pages. Heartbeats come from the asyncio thread, so they prove the engine loop is alive.
"""
from __future__ import annotations

import asyncio
import collections
import os
import signal
from typing import cast
from dataclasses import dataclass, field

import structlog
import zmq

from slipstream.api.addresses import check_bind_address
from slipstream.api.engine import Engine
from slipstream.api.interface import Messages, Prompt
from slipstream.api.protocol import (
    MAX_IMAGE_BYTES,
    MAX_MESSAGE_BYTES,
    Abort,
    AbortReply,
    Bye,
    ChatPromptReply,
    ChatPromptRequest,
    Delta,
    Error,
    Generate,
    HealthReply,
    HealthRequest,
    Heartbeat,
    LoadLoraRequest,
    LoraReply,
    MetricsReply,
    MetricsRequest,
    Result,
    Shutdown,
    StatsReply,
    StatsRequest,
    UnloadLoraRequest,
    error_to_wire,
    output_to_wire,
)
from slipstream.api.worker_io import NOT_READING, WorkerIO
from slipstream.errors import (
    EngineClosedError,
    InvalidRequestError,
    OverloadedError,
    SlipstreamError,
    WorkerShuttingDownError,
    WorkerUnavailableError,
)
from slipstream.images import check_image_fields, load_images, model_accepts_images, require_vision
from slipstream.outputs import CompletionOutput
from slipstream.params import EngineConfig, SamplingParams

log = structlog.get_logger(__name__)


@dataclass
class WorkerLimits:
    max_queued: int = 256  # unfinished requests beyond max_batch_size; more are refused (Overloaded)
    max_message_bytes: int = MAX_MESSAGE_BYTES
    heartbeat_s: float = 0.5
    shutdown_timeout_s: float = 10.0  # in-flight work gets this long to finish after SIGTERM/SIGINT
    metrics_port: int | None = None  # serve Prometheus text on http://127.0.0.1:PORT/metrics (0: any port)
    # Per client: output frames queued that its connection has not taken yet. A client that lets
    # this many pile up has stopped reading; it is dropped and its requests aborted (pages freed).
    max_unsent_frames: int = 1000
    max_image_bytes: int = MAX_IMAGE_BYTES  # one Generate's encoded images, allowed beyond max_message_bytes

    def __post_init__(self) -> None:
        least = dict(max_queued=0, max_message_bytes=1, max_unsent_frames=1, max_image_bytes=0)
        for name, low in least.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise InvalidRequestError(f"WorkerLimits.{name} must be an int >= {low}, got {value!r}")
        if not self.heartbeat_s > 0:
            raise InvalidRequestError(f"WorkerLimits.heartbeat_s must be > 0, got {self.heartbeat_s!r}")
        if not self.shutdown_timeout_s >= 0:
            raise InvalidRequestError(f"WorkerLimits.shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s!r}")


@dataclass(eq=False)
class _Session:
    identity: bytes
    tag: str  # hex identity: prefixes engine request ids and names the client in logs
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    gone: bool = False  # nobody to answer: cancelled tasks send nothing
    requests: int = 0
    told: list[str] = field(default_factory=list)  # ids of requests aborted while it was not reading


class Worker:
    def __init__(self, config: EngineConfig, address: str, limits: WorkerLimits | None = None):
        self.config, self.address = config, address
        self.limits = limits or WorkerLimits()
        self.engine = Engine(config)
        self._sessions: dict[bytes, _Session] = {}
        self._inflight = 0
        self._draining = False
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._exit_code = 0
        self._force = False
        self.num_requests = self.num_overloaded = self.num_slow_clients = 0
        # clients dropped for not reading -> ids of the requests that were aborted with them; told on
        # their next message (a client that reads again must not wait forever on those)
        self._cut_off: collections.OrderedDict[bytes, list[str]] = collections.OrderedDict()
        self.io: WorkerIO | None = None
        self._background: set[asyncio.Task] = set()

    # --- lifecycle ------------------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or stop()); returns the process exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, signal.Signals(sig).name)
        check_bind_address(self.address)  # before the model loads: a taken address fails now, in one line
        log.info("worker_starting", model=self.config.model, device=self.config.device, address=self.address,
                 pid=os.getpid())
        await self.engine.start()
        metrics_server = None
        if self.limits.metrics_port is not None:
            from slipstream.metrics import serve_metrics

            metrics_server, _ = serve_metrics(self.engine.metrics.registry, "127.0.0.1", self.limits.metrics_port)
            log.info("metrics_endpoint", url=f"http://127.0.0.1:{metrics_server.server_port}/metrics")
        try:
            await self._serve_until_stopped(loop)
        finally:
            if metrics_server is not None:
                metrics_server.shutdown()
            await self.engine.close()
        log.info("worker_stopped", reason=self._stop_reason, exit_code=self._exit_code)
        return self._exit_code

    async def _serve_until_stopped(self, loop: asyncio.AbstractEventLoop) -> None:
        # warm up before binding: the first client never pays for lazy initialisation. A fixed
        # seed, so the engine's own seed sequence for unseeded requests is left as it was.
        # Not counted in the metrics: a scrape shows the traffic clients sent (issue 37).
        self.engine.metrics.muted = True
        try:
            await self.engine.complete("warmup", SamplingParams(max_tokens=2, temperature=0.0, seed=0, ignore_eos=True))
        finally:
            self.engine.metrics.muted = False
        call = loop.call_soon_threadsafe
        self.io = WorkerIO(zmq.Context.instance(), self.address,
                           deliver=lambda ident, msg, params: call(self._on_message, ident, msg, params),
                           gone=lambda ident, why: call(self._on_gone, ident, why),
                           died=lambda e: call(self.stop, f"socket thread died: {e!r}", 1),
                           max_message_bytes=self.limits.max_message_bytes,
                           max_unsent_frames=self.limits.max_unsent_frames,
                           max_image_bytes=self.limits.max_image_bytes)
        self.io.start()
        beat = asyncio.create_task(self._heartbeats(), name="slipstream-worker-heartbeat")
        log.info("worker_ready", address=self.address, kv_pages=(await self.engine.stats())["kv_pages_total"],
                 max_queued=self.limits.max_queued)
        await self._stop.wait()
        await self._shutdown()
        beat.cancel()
        self.io.request_stop()
        await self.io.join()
        self.io.remove_socket_file()  # (the thread did, unless it outlived join's timeout)

    def stop(self, reason: str = "stop", exit_code: int = 0) -> None:
        if self._stop.is_set():  # a second signal: do not wait for the deadline
            self._force = True
            for s in self._sessions.values():
                for t in s.tasks.values():
                    t.cancel()
            return
        self._stop_reason, self._exit_code = reason, exit_code
        self._stop.set()

    async def _shutdown(self) -> None:
        self._draining = True
        deadline = 0.0 if self._force else self.limits.shutdown_timeout_s
        log.info("worker_shutting_down", reason=self._stop_reason, inflight=self._inflight, deadline_s=deadline)
        for s in self._sessions.values():
            self._io.send(s.identity, Shutdown(deadline_s=deadline, reason=self._stop_reason))
        tasks = [t for s in self._sessions.values() for t in s.tasks.values()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=deadline)
            for t in late:  # their clients get WorkerShuttingDownError (see _serve)
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            if late:
                log.warning("shutdown_deadline_aborted", count=len(late))

    # --- dispatch (asyncio thread) --------------------------------------------------------------

    def _on_message(self, identity: bytes, msg, params: SamplingParams | None) -> None:
        session = self._sessions.get(identity)
        if session is None:
            if isinstance(msg, Bye):
                self._cut_off.pop(identity, None)
                return
            session = self._sessions[identity] = _Session(identity, identity.hex())
            log.info("client_connected", client=session.tag, clients=len(self._sessions))
            session.told = self._cut_off.pop(identity, [])
            for rid in session.told:
                self._io.send(identity, error_to_wire(WorkerUnavailableError(
                    "the worker dropped this client because it stopped reading; the request was aborted"),
                    request_id=rid))
        if isinstance(msg, Generate):
            self._admit(session, msg, cast(SamplingParams, params))  # (decoded with every Generate)
        elif isinstance(msg, Abort | LoadLoraRequest | UnloadLoraRequest):
            work = self._abort(session, msg) if isinstance(msg, Abort) else self._lora(session, msg)
            task = asyncio.create_task(work)
            self._background.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._background.discard)
        elif isinstance(msg, StatsRequest):
            self._io.send(identity, StatsReply(seq=msg.seq, stats=self.stats()))
        elif isinstance(msg, HealthRequest):
            self._io.send(identity, self._health(msg.seq))
        elif isinstance(msg, ChatPromptRequest | MetricsRequest):
            self._io.send(identity, self._answer(msg))
        elif isinstance(msg, Bye):
            self._drop(session, "closed")

    def _on_gone(self, identity: bytes, why: str) -> None:
        session = self._sessions.get(identity)
        if session is not None:
            self._drop(session, why)

    def _drop(self, session: _Session, why: str) -> None:
        session.gone = True
        self._sessions.pop(session.identity, None)
        for task in session.tasks.values():
            task.cancel()  # Engine aborts a cancelled request and frees its pages
        if why == NOT_READING:
            self._remember_cut_off(session)
        (log.warning if why == NOT_READING else log.info)(
            "client_gone", client=session.tag, reason=why, aborted=len(session.tasks), requests=session.requests,
            clients=len(self._sessions))

    def _remember_cut_off(self, session: _Session) -> None:
        """A client dropped for not reading may read again: keep what to tell it then."""
        self.num_slow_clients += 1
        if session.tasks or session.told:  # told again: it may not have read that either
            self._cut_off[session.identity] = session.told + list(session.tasks)
            while len(self._cut_off) > 1024:  # bounded: the oldest are least likely to come back
                self._cut_off.popitem(last=False)

    def _admit(self, session: _Session, msg: Generate, params: SamplingParams) -> None:
        rid = msg.request_id
        error: SlipstreamError | None = None
        if self._draining:
            error = WorkerShuttingDownError("the worker is shutting down and admits no new request")
        elif rid in session.tasks:
            error = InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        elif params.n > 1:  # one Generate is one completion; slipstream.Client fans n out itself
            error = InvalidRequestError("n > 1: send n requests with n=1 (slipstream.Client does)", param="n")
        elif self._inflight >= self.config.max_batch_size + self.limits.max_queued:
            self.num_overloaded += 1
            error = OverloadedError(f"{self._inflight} requests in flight; the worker queues at most "
                                    f"{self.limits.max_queued} beyond its batch of {self.config.max_batch_size}")
        if error is not None:
            self._io.send(session.identity, error_to_wire(error, request_id=rid))
            return
        self._inflight += 1
        session.requests += 1
        self.num_requests += 1
        session.tasks[rid] = asyncio.create_task(self._serve(session, msg, params))

    async def _serve(self, session: _Session, msg: Generate, params: SamplingParams) -> None:
        rid, send, ident = msg.request_id, self._io.send, session.identity
        engine_id = f"{session.tag}/{rid}"  # unique across clients; the client sees its own id
        try:
            tools = msg.messages is not None and (msg.tools is not None or msg.tool_choice is not None)
            prompt = msg.prompt if msg.messages is None or tools else await self.engine.chat_prompt(msg.messages)
            kw: dict = {}
            if msg.images:  # counted, then refused for a text model before anything is decoded; off the loop
                fields = [f"images[{i}]" for i in range(len(msg.images))]
                check_image_fields(fields)
                require_vision(model_accepts_images(self.engine.model_config), fields[0])
                kw["images"] = await load_images(msg.images, fields)
            if tools:  # Engine.chat renders the tools, adds their grammar and parses the calls
                kw.update(tools=msg.tools, tool_choice=msg.tool_choice, parallel_tool_calls=msg.parallel_tool_calls)
            if msg.stream:
                stream = (self.engine.chat_stream(cast(Messages, msg.messages), params, request_id=engine_id, **kw)
                          if tools else self.engine.stream(cast(Prompt, prompt), params, request_id=engine_id, **kw))
                async for d in stream:
                    send(ident, Delta(request_id=rid, text=d.text, token_ids=d.token_ids,
                                      finish_reason=d.finish_reason, usage=d.usage, content=d.content,
                                      tool_calls=d.tool_calls))
            else:
                out = await (self.engine.chat(cast(Messages, msg.messages), params, request_id=engine_id, **kw)
                             if tools else self.engine.complete(cast(Prompt, prompt), params, request_id=engine_id, **kw))
                one = cast(CompletionOutput, out)  # (n == 1: the worker admits no fan-out)
                send(ident, Result(request_id=rid, output=output_to_wire(one, rid)))
        except asyncio.CancelledError:
            if not session.gone:  # cancelled at the shutdown deadline, and the client is still there
                late = WorkerShuttingDownError("the worker shut down before the request finished")
                send(ident, error_to_wire(late, request_id=rid))
            raise
        except SlipstreamError as e:
            send(ident, error_to_wire(e, request_id=rid))
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the worker
            log.exception("request_failed", client=session.tag, request_id=rid)
            send(ident, Error(code="WorkerError", message=f"internal error: {e!r}", request_id=rid))
        finally:
            session.tasks.pop(rid, None)
            self._inflight -= 1

    async def _abort(self, session: _Session, msg: Abort) -> None:
        engine_id = f"{session.tag}/{msg.request_id}"
        aborted = await self.engine.abort(engine_id)
        task = session.tasks.get(msg.request_id)
        if not aborted and task is not None and not task.done():
            # the Generate's task was created before this one, so after one yield it has submitted
            await asyncio.sleep(0)
            aborted = await self.engine.abort(engine_id)
        if not session.gone:
            self._io.send(session.identity, AbortReply(seq=msg.seq, aborted=aborted))

    async def _lora(self, session: _Session, msg: LoadLoraRequest | UnloadLoraRequest) -> None:
        """Engine.load_lora / unload_lora (the folder read off the loop: requests go on meanwhile)."""
        reply: LoraReply | Error
        try:
            if isinstance(msg, LoadLoraRequest):
                reply = LoraReply(seq=msg.seq, adapter=await self.engine.load_lora(msg.lora_name, msg.lora_path))
            else:
                await self.engine.unload_lora(msg.lora_name)
                reply = LoraReply(seq=msg.seq)
        except SlipstreamError as e:
            reply = error_to_wire(e, seq=msg.seq)
        except Exception as e:  # noqa: BLE001 - answered as an error; the worker goes on
            log.exception("call_failed", type=type(msg).__name__)
            reply = Error(code="WorkerError", message=f"internal error: {e!r}", seq=msg.seq)
        if not session.gone:
            self._io.send(session.identity, reply)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.limits.heartbeat_s)
            try:
                await self.engine.stats()
            except EngineClosedError as e:
                log.error("engine_loop_died", action="stopping the worker", error=str(e))
                self.stop("engine died", 1)
                return
            for s in list(self._sessions.values()):
                self._io.send(s.identity, Heartbeat(inflight=len(s.tasks)))

    @property
    def _io(self) -> WorkerIO:
        """The socket thread's side (set by start(); every message handler runs after it)."""
        assert self.io is not None
        return self.io

    # --- introspection --------------------------------------------------------------------------

    def stats(self) -> dict:
        try:
            stats = self.engine.stats_now()
        except EngineClosedError:
            stats = {}
        stats.update(clients=len(self._sessions), inflight=self._inflight, requests=self.num_requests,
                     overloaded=self.num_overloaded, slow_clients=self.num_slow_clients,
                     bad_messages=self.io.bad_messages if self.io else 0,
                     draining=self._draining)
        return stats

    def _answer(self, msg: ChatPromptRequest | MetricsRequest) -> ChatPromptReply | MetricsReply | Error:
        """Calls the engine answers at once, without generating: Client.chat_prompt / metrics_text."""
        try:
            if isinstance(msg, ChatPromptRequest):
                return ChatPromptReply(seq=msg.seq, prompt=self.engine.submitter.chat_prompt(msg.messages))
            return MetricsReply(seq=msg.seq, text=self.engine.metrics.text())
        except SlipstreamError as e:
            return error_to_wire(e, seq=msg.seq)
        except Exception as e:  # noqa: BLE001 - answered as an error; the worker goes on
            log.exception("call_failed", type=type(msg).__name__)
            return Error(code="WorkerError", message=f"internal error: {e!r}", seq=msg.seq)

    def _health(self, seq: int) -> HealthReply:
        try:
            running = self.engine.stats_now() is not None
        except EngineClosedError:
            running = False
        return HealthReply(seq=seq, ready=running and not self._draining, draining=self._draining,
                           model=self.config.model, pid=os.getpid(), heartbeat_s=self.limits.heartbeat_s,
                           max_message_bytes=self.limits.max_message_bytes,
                           chat_template=bool(getattr(self.engine.tokenizer, "chat_template", None)),
                           accepts_images=running and model_accepts_images(self.engine.model_config),
                           max_image_bytes=self.limits.max_image_bytes,
                           region_skills=running and self.engine.region_skills,
                           max_model_len=self.engine.max_model_len if running else 0,
                           loras=[{k: a[k] for k in ("name", "path", "rank", "targets")} for a in self.engine.loras()]
                           if running else [])


def serve(config: EngineConfig, address: str, limits: WorkerLimits | None = None) -> int:
    """Run a worker in this process until a signal stops it (blocking)."""
    import uvloop

    async def main() -> int:
        return await Worker(config, address, limits).run()

    return uvloop.run(main())
