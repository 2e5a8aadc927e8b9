"""The Client's connection to a `slipstream worker`: socket, handshake, reconnection, routing, liveness.

A slipstream.Client (slipstream/api/client.py, the API's methods) holds one `WorkerConnection`;
its requests (slipstream/api/client_requests.py) are sent and routed through it. One ZMQ DEALER socket per client; one pump task reads it, routes each message to
the request or call that waits for it, and watches liveness. A call never hangs: request waits fail
with WorkerUnavailableError when the connection drops (socket monitor) or when nothing, not even a
heartbeat, has come from the worker for `timeout` seconds; replies to calls are awaited with
`timeout`; sends never block (a full queue raises at once).

While the connection is down, new calls fail at once and nothing is queued for later: a dropped
connection's socket is closed (discarding what was sent into it after the worker went) and a fresh
one connects, and nothing is sent until its handshake with a worker succeeds. So a worker restarted
at the same address never runs a request that was given up on, and the same Client works again.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Self

import msgspec
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from slipstream import errors
from slipstream.api.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AbortReply,
    Bye,
    ChatPromptReply,
    Delta,
    Error,
    HealthReply,
    HealthRequest,
    LoraReply,
    MetricsReply,
    Result,
    Shutdown,
    StatsReply,
    error_from_wire,
    frame_decoder,
    output_from_wire,
)
from slipstream.errors import ProtocolVersionError, WorkerError, WorkerUnavailableError
from slipstream.outputs import StreamDelta

log = structlog.get_logger(__name__)

_monitor_ids = itertools.count()
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_REPLIES = AbortReply | StatsReply | HealthReply | ChatPromptReply | MetricsReply | LoraReply | Error


@dataclass(eq=False)
class Pending:
    request_id: str
    sent_at: float  # perf_counter: the client-side arrival time of the request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class WorkerConnection:
    """A Client's connection and the waiters it wakes: `pending` requests by id, `_calls` by seq."""

    def __init__(self, address: str, timeout: float, connect_timeout: float | None):
        self.address = address
        self.timeout = timeout  # longest silence from the worker while a call waits on it
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self.info: HealthReply | None = None  # the worker's answer to the handshake
        self.draining = False  # the worker announced its shutdown
        self.pending: dict[str, Pending] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._seq = itertools.count(1)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = frame_decoder()
        self._last_heard = 0.0
        # zmq.asyncio sockets (None: not open); their NOBLOCK calls return futures that are done
        self._sock: Any = None
        self._monitor: Any = None
        self._pump_task: asyncio.Task | None = None
        self.closed = False
        self._up = asyncio.Event()  # set while a connection to a worker is established (monitor)
        self._was_up = False
        self._refresh: asyncio.Task | None = None  # re-handshake after a reconnection

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> Self:
        """Connect and handshake; raises WorkerUnavailableError if no worker answers in time."""
        try:
            self._open_socket()
        except zmq.ZMQError as e:
            await self.close()
            raise WorkerUnavailableError(f"cannot connect to {self.address!r}: {e}") from e
        self._pump_task = asyncio.create_task(self._pump(), name="slipstream-client-pump")
        try:
            deadline = time.perf_counter() + self.connect_timeout
            try:
                await asyncio.wait_for(self._up.wait(), self.connect_timeout)
            except TimeoutError:
                raise WorkerUnavailableError(f"no worker answered at {self.address} within "
                                             f"{self.connect_timeout:g} s") from None
            self.info = await self.health(timeout=max(0.0, deadline - time.perf_counter()))
        except BaseException:
            await self.close()
            raise
        if self.info.heartbeat_s * 2 > self.timeout:
            log.warning("client_timeout_too_short", detail="shorter than two worker heartbeats; calls may fail spuriously",
                        timeout=self.timeout, heartbeat_s=self.info.heartbeat_s)
        return self

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._sock is not None:
            self.send_nowait(Bye(v=PROTOCOL_VERSION))  # the worker aborts our requests at once
        for task in (self._pump_task, self._refresh):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._fail_all(WorkerUnavailableError("the client is closed"))
        self._close_socket(linger=100)  # lets the Bye leave

    @property
    def connected(self) -> bool:
        """True while a connection to a worker is up; calls made while it is down fail at once."""
        return self._up.is_set() and not self.closed

    async def wait_connected(self, timeout: float) -> None:
        """Wait until the connection is up again (ZMQ reconnects by itself), or raise WorkerUnavailableError."""
        self._check_started()
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
        except TimeoutError:
            raise WorkerUnavailableError(f"no worker at {self.address} within {timeout:g} s") from None
        if self._refresh is not None:  # the new worker's handshake: info describes it, not the old one
            await asyncio.gather(self._refresh, return_exceptions=True)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # --- calls and the handshake ---------------------------------------------------------------

    async def call(self, msg, timeout: float | None = None):
        self.check_open()
        fut = asyncio.get_running_loop().create_future()
        self._calls[msg.seq] = fut
        try:
            self.send(msg)
            return await asyncio.wait_for(fut, self.timeout if timeout is None else timeout)
        except TimeoutError:
            raise WorkerUnavailableError(f"no reply from the worker at {self.address} within "
                                         f"{self.timeout if timeout is None else timeout:g} s") from None
        finally:
            self._calls.pop(msg.seq, None)


    async def health(self, timeout: float | None = None) -> HealthReply:
        return await self.call(HealthRequest(v=PROTOCOL_VERSION, seq=next(self._seq)), timeout)

    def next_seq(self) -> int:
        """The seq of a new call (its reply is routed by it)."""
        return next(self._seq)

    def encode(self, obj) -> bytes:
        return self._enc.encode(obj)


    # --- socket ---------------------------------------------------------------------------------

    def _check_started(self) -> None:
        if self._sock is None or self.closed:
            raise WorkerUnavailableError("the client is not started (use `async with Client(...)`) or is closed")

    def check_open(self) -> None:
        self._check_started()
        if not self._up.is_set():
            raise WorkerUnavailableError(f"not connected to the worker at {self.address} (it went away; "
                                         "calls work again once a worker answers there)")

    def send(self, msg) -> None:
        try:
            self._sock.send(self._enc.encode(msg), zmq.NOBLOCK).result()  # NOBLOCK: done at once
        except zmq.Again:
            raise WorkerUnavailableError(f"cannot send to the worker at {self.address}: queue full") from None

    def send_nowait(self, msg) -> None:
        """Best effort (Abort, Bye), and only on a live connection: a new worker must not get them."""
        if not self._up.is_set():
            return
        try:
            self.send(msg)
        except (WorkerUnavailableError, zmq.ZMQError):
            pass

    def _open_socket(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        # A loop too busy to read lets at most this many frames pile up here; then the worker's own
        # bound (max_unsent_frames) is reached and it drops this client rather than work for nobody.
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        address = f"inproc://slipstream-client-monitor-{next(_monitor_ids)}"  # unique: sockets are replaced
        self._sock.monitor(address, _EVENTS)
        self._monitor = ctx.socket(zmq.PAIR)
        self._monitor.connect(address)
        self._sock.connect(self.address)

    def _close_socket(self, linger: int = 0) -> None:
        if self._sock is None:
            return
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=linger)

    async def _pump(self) -> None:
        try:
            await self._pump_forever()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # without the pump nothing would ever wake a waiter: fail them
            log.error("client_pump_died", error=repr(e))
            self.closed = True
            self._fail_all(WorkerError(f"client receive loop died: {e!r}"))
            raise

    async def _pump_forever(self) -> None:
        tick = max(0.01, min(self.timeout / 4, 0.25))
        checked = time.perf_counter()
        while True:
            sock, poller = self._sock, zmq.asyncio.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            while sock is self._sock:  # until a lost connection replaces the socket
                events = dict(await poller.poll(tick * 1000))
                self._drain()
                if self._monitor in events:
                    self._connection_events()
                if time.perf_counter() - checked >= tick:  # O(pending): not on every frame
                    checked = time.perf_counter()
                    self._check_liveness()

    def _connection_events(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK).result())["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._up.clear()
                self._drain()  # data the worker sent before it went is already queued: use it
                self._fail_all(WorkerUnavailableError(f"lost the connection to the worker at {self.address}"))
                log.warning("worker_connection_lost", address=self.address)
                # What was sent after the worker went sits in this socket's queue; ZMQ would hand it
                # to whoever answers at the address next. Discard it with the socket; start afresh.
                self._close_socket()
                self._open_socket()
                return
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._up.set()
                if self._was_up:  # a reconnection: maybe another worker process; ask who it is
                    log.info("worker_reconnected", address=self.address)
                    self.draining = False
                    self._refresh = asyncio.create_task(self._rehandshake(), name="slipstream-client-rehandshake")
                self._was_up = True

    async def _rehandshake(self) -> None:
        try:
            self.info = await self.health()
        except WorkerError as e:  # gone again: the next reconnection retries
            log.info("reconnect_handshake_failed", error=repr(e))

    def _drain(self) -> None:
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK).result()
            except zmq.Again:
                return
            self._last_heard = time.perf_counter()
            try:
                frame = self._dec.decode(data)
            except msgspec.DecodeError as e:
                log.warning("undecodable_frame", error=str(e))
                continue
            if frame.v != PROTOCOL_VERSION:
                self._fail_all(ProtocolVersionError(f"worker speaks protocol {frame.v}, client {PROTOCOL_VERSION}"))
                continue
            for msg in frame.msgs:
                self._route(msg)

    def _route(self, msg) -> None:
        if isinstance(msg, Delta | Result) or (isinstance(msg, Error) and msg.request_id is not None):
            p = self.pending.get(msg.request_id) if msg.request_id is not None else None
            if p is None:
                return  # a request we already gave up on (aborted, cancelled, timed out)
            if isinstance(msg, Delta):
                p.queue.put_nowait(StreamDelta(p.request_id, msg.text, msg.token_ids, msg.finish_reason,
                                                 msg.usage, msg.content, msg.tool_calls))
            elif isinstance(msg, Result):
                p.queue.put_nowait(output_from_wire(msg.output, p.sent_at))
            else:
                p.queue.put_nowait(error_from_wire(msg))
        elif isinstance(msg, _REPLIES):
            fut = self._calls.get(msg.seq) if msg.seq is not None else None
            if fut is not None and not fut.done():
                fut.set_exception(error_from_wire(msg)) if isinstance(msg, Error) else fut.set_result(msg)
            elif isinstance(msg, Error):
                log.warning("worker_error", code=msg.code, detail=msg.message)
        elif isinstance(msg, Shutdown):
            self.draining = True
            log.info("worker_draining", deadline_s=msg.deadline_s, reason=msg.reason)
        # Heartbeat: receiving it was the point (_last_heard)

    def _check_liveness(self) -> None:
        now = time.perf_counter()
        for p in list(self.pending.values()):
            if now - max(self._last_heard, p.sent_at) > self.timeout:
                self.pending.pop(p.request_id, None)
                self.send_nowait(Abort(v=PROTOCOL_VERSION, seq=0, request_id=p.request_id))  # if it wakes up
                p.queue.put_nowait(WorkerUnavailableError(
                    f"no message from the worker at {self.address} for {self.timeout:g} s"))

    def _fail_all(self, error: errors.SlipstreamError) -> None:
        pending, self.pending = self.pending, {}
        for p in pending.values():
            p.queue.put_nowait(type(error)(*error.args))  # one instance per waiter: clean tracebacks
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(type(error)(*error.args))
