"""The worker's socket thread: all ZMQ IO, decoding and validation happen here, off the engine loop.

Inbound: ROUTER frame -> size check -> msgpack decode -> version and parameter checks -> the
message is handed to the asyncio loop with call_soon_threadsafe. Anything wrong is answered from
this thread with an Error; the engine never sees it. Outbound: the loop appends (identity, msg)
to a deque and pokes an inproc socket; this thread drains the deque, groups messages per client
into one Frame, encodes into a reused buffer and sends. A send that fails because the peer is gone
(ROUTER_MANDATORY: EHOSTUNREACH) or not reading (high-water mark) reports the client as gone.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from typing import Callable

import msgspec
import structlog
import zmq

from slipstream.api.addresses import check_bind_address, ipc_path
from slipstream.api.protocol import (
    MAX_IMAGE_BYTES,
    PROTOCOL_VERSION,
    ClientMsgDecoder,
    Encoder,
    Frame,
    Generate,
    Header,
    error_to_wire,
)
from slipstream.errors import (
    AddressInUseError,
    InvalidRequestError,
    MessageTooLargeError,
    ProtocolError,
    ProtocolVersionError,
    SlipstreamError,
    WorkerError,
)
from slipstream.params import SamplingParams

log = structlog.get_logger(__name__)

_wake_ids = itertools.count()
NOT_READING = "not reading (send queue full)"  # the reason given to `gone` for a client that stopped reading
Deliver = Callable[[bytes, object, SamplingParams | None], object]  # (identity, message, params)
Gone = Callable[[bytes, str], object]  # (identity, reason); what the callbacks return is ignored
Died = Callable[[BaseException], object]


class WorkerIO:
    def __init__(self, ctx: zmq.Context, address: str, deliver: Deliver, gone: Gone, died: Died,
                 max_message_bytes: int, max_unsent_frames: int = 1000, max_unread_frames: int = 100_000,
                 max_image_bytes: int = MAX_IMAGE_BYTES):
        """The callbacks run on this object's thread; they must hop to the loop themselves.

        max_unsent_frames bounds, per client, the frames queued for it that its connection has not
        taken yet (ZMQ SNDHWM; the OS socket buffers hold some more). A client that lets them pile
        up has stopped reading: its next send fails at once (ROUTER_MANDATORY) and it is reported
        gone, so its requests are aborted instead of running for nobody.
        """
        self.max_message_bytes = max_message_bytes
        self.max_image_bytes = max_image_bytes  # a Generate's images may add this much to a frame
        self._deliver, self._gone, self._died = deliver, gone, died
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends to a vanished peer raise, not vanish
        # ZMQ drops (and disconnects) a peer whose frame exceeds this before it is ever buffered in
        # full; frames between max_message_bytes and this are read and answered with an Error.
        self.router.setsockopt(zmq.MAXMSGSIZE, 4 * (max_message_bytes + max_image_bytes) + 1024)
        self.router.setsockopt(zmq.SNDHWM, max_unsent_frames)
        self.router.setsockopt(zmq.RCVHWM, max_unread_frames)
        self.router.setsockopt(zmq.LINGER, 500)  # final replies get a moment to leave at exit
        try:
            check_bind_address(address)  # again: Worker.run checked before the model loaded, seconds ago
            self.router.bind(address)  # here, on the caller's thread, so a bad address raises to it
        except zmq.ZMQError as e:
            self.router.close(linger=0)
            raise WorkerError(f"cannot bind {address!r}: {e}") from e
        except AddressInUseError:
            self.router.close(linger=0)
            raise
        # ZMQ leaves an ipc socket file behind at close; ours is removed then (if it is still ours)
        path = ipc_path(address)
        self._socket_file = (path, path.stat().st_ino) if path is not None and path.exists() else None
        wake = f"inproc://slipstream-worker-wake-{next(_wake_ids)}"
        self._wake_rx = ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx = ctx.socket(zmq.PUSH)  # used only by the asyncio thread
        self._wake_tx.connect(wake)
        self._out: collections.deque[tuple[bytes, object]] = collections.deque()
        self._wake_pending = False
        self._stopping = False
        self._decoder = ClientMsgDecoder()
        self._params = msgspec.msgpack.Decoder(SamplingParams)
        self._encoder = Encoder()
        self.bad_messages = 0
        self.frames_in = 0
        self.frames_out = 0
        self._thread = threading.Thread(target=self._run, name="slipstream-worker-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, identity: bytes, msg: object) -> None:
        """Queue one message for a client (asyncio thread). Cheap: no encoding, no syscall if queued."""
        self._out.append((identity, msg))
        if not self._wake_pending:
            self._wake_pending = True
            self._poke()

    def _poke(self) -> None:
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # wake-ups are already queued (or the thread is gone): nothing to add
            pass

    def request_stop(self) -> None:
        """Asyncio thread: flush what is queued, then close the sockets. Then await join()."""
        self._stopping = True
        self._poke()

    async def join(self, timeout: float = 5.0) -> None:
        await asyncio.to_thread(self._thread.join, timeout)
        self._wake_tx.close(linger=0)

    # --- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(100))
                if self._wake_rx in events:
                    while True:
                        try:
                            self._wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    self._wake_pending = False  # before draining: a later send() wakes us again
                if self.router in events:
                    for _ in range(512):  # bounded, so queued outputs are not starved by input
                        try:
                            frames = self.router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self._inbound(frames)
                        except Exception as e:  # noqa: BLE001 - one bad frame must not stop the thread
                            log.exception("frame_handling_failed", error=repr(e))
                self._flush()
                if self._stopping and not self._out:
                    break
        except Exception as e:  # noqa: BLE001 - the worker must learn its socket thread died
            log.error("socket_thread_died", error=repr(e))
            self._died(e)
        finally:
            self._wake_rx.close(linger=0)
            self.router.close()
            self.remove_socket_file()

    def remove_socket_file(self) -> None:
        """Unlink the ipc socket file this worker bound, unless another worker has since bound over it."""
        if self._socket_file is None:
            return
        path, inode = self._socket_file
        self._socket_file = None
        try:
            if path.stat().st_ino == inode:
                path.unlink()
        except OSError:
            pass

    def _inbound(self, frames: list[bytes]) -> None:
        self.frames_in += 1
        identity = frames[0]
        if len(frames) != 2:
            return self._refuse(identity, ProtocolError(f"expected one frame per message, got {len(frames) - 1}"))
        data = frames[1]
        if len(data) > self.max_message_bytes:
            too_large = self._too_large(data)
            if too_large is not None:
                return self._refuse(identity, *too_large)
        try:
            msg = self._decoder.decode(data)
        except msgspec.DecodeError as e:
            header = self._decoder.header(data)
            refusal: SlipstreamError = ProtocolError(str(e))
            if header is not None and header.v is not None and header.v != PROTOCOL_VERSION:
                refusal = ProtocolVersionError(f"protocol version {header.v} is not supported (worker speaks "
                                               f"{PROTOCOL_VERSION})")
            return self._refuse(identity, refusal, header)
        except Exception as e:  # noqa: BLE001 - e.g. RecursionError on absurd nesting: still just bad input
            return self._refuse(identity, ProtocolError(f"undecodable message: {e!r}"))
        header = Header(msg.v, getattr(msg, "request_id", None), getattr(msg, "seq", None))
        if msg.v != PROTOCOL_VERSION:
            return self._refuse(identity, ProtocolVersionError(
                f"protocol version {msg.v} is not supported (worker speaks {PROTOCOL_VERSION})"), header)
        params = None
        if isinstance(msg, Generate):
            if (msg.prompt is None) == (msg.messages is None):
                return self._refuse(identity, InvalidRequestError("give exactly one of prompt and messages"), header)
            try:
                params = self._params.decode(msg.params)
            except msgspec.DecodeError as e:  # (a check of SamplingParams' own raised inside: its field kept)
                param = getattr(e.__cause__, "param", None)
                return self._refuse(identity, InvalidRequestError(f"invalid sampling params: {e}", param=param),
                                    header)
        self._deliver(identity, msg, params)

    def _too_large(self, data: bytes) -> tuple[SlipstreamError, Header | None] | None:
        """A frame over max_message_bytes is refused unless image bytes (within max_image_bytes) are
        what it carries beyond that; the error names `images` when they are to blame."""
        header = self._decoder.header(data)
        images = len(header.images) if header is not None and len(header.images) > 1 else 0  # ([] is 1 byte)
        if len(data) - images > self.max_message_bytes:
            prompt = len(header.prompt) if header is not None else 0
            if len(data) - images - prompt <= self.max_message_bytes:  # the prompt is to blame: as in process
                return InvalidRequestError(f"prompt: {prompt:,} bytes encoded exceed this worker's max_message_bytes="
                                           f"{self.max_message_bytes:,} (slipstream worker --max-message-bytes)",
                                           param="prompt"), header
            return MessageTooLargeError(f"message of {len(data):,} bytes ({images:,} of them images) exceeds "
                                        f"max_message_bytes={self.max_message_bytes:,}"), header
        if images > self.max_image_bytes:
            return MessageTooLargeError(f"images: {images:,} bytes of images exceed this worker's "
                                        f"max_image_bytes={self.max_image_bytes:,}", param="images"), header
        return None

    def _refuse(self, identity: bytes, error: SlipstreamError, header: Header | None = None) -> None:
        self.bad_messages += 1
        log.info("bad_message", client=identity.hex(), error=type(error).__name__, detail=str(error)[:200])
        self._out.append((identity, error_to_wire(error, header.request_id if header else None,
                                                  header.seq if header else None)))

    def _flush(self) -> None:
        if not self._out:
            return
        batches: dict[bytes, list] = {}
        while self._out:
            identity, msg = self._out.popleft()
            batches.setdefault(identity, []).append(msg)
        for identity, msgs in batches.items():
            try:
                data = self._encoder.encode(Frame(PROTOCOL_VERSION, msgs))
                self.router.send(identity, zmq.SNDMORE | zmq.NOBLOCK)
                self.router.send(data, zmq.NOBLOCK, copy=True)  # copies: the buffer is reused next time
                self.frames_out += 1
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    self._gone(identity, "disconnected")
                elif e.errno == zmq.EAGAIN:
                    self._gone(identity, NOT_READING)
                else:
                    raise
            except Exception as e:  # noqa: BLE001 - e.g. unencodable: lose this batch, not the thread
                log.exception("send_failed", client=identity.hex(), error=repr(e))
                self._gone(identity, f"send failed: {e!r}")
