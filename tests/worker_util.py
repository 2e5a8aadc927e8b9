"""Helpers for the worker tests: a `slipstream worker` subprocess on an ipc or tcp socket."""
from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq

from slipstream import EngineConfig
from slipstream.api.protocol import PROTOCOL_VERSION, HealthRequest

# The same engine settings on both sides, so the worker's results can be compared with Engine's.
# Batch-invariant on both sides: the worker batches requests the reference ran alone.
ENGINE = dict(model="tiny-random", max_batch_size=16, max_num_batched_tokens=64, kv_cache_tokens=4096, page_size=8,
              batch_invariant=True)


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(**{**ENGINE, **kw})


@dataclass
class WorkerProc:
    proc: subprocess.Popen
    address: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """Never leaves a process behind: SIGTERM, then SIGKILL."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def ipc_address(tmp_path: Path) -> str:
    path = tmp_path / "w.sock"
    if len(str(path)) > 90:  # ipc paths are limited to ~107 bytes (sun_path)
        path = Path(tempfile.mkdtemp(prefix="sw", dir="/tmp")) / "w.sock"
    return f"ipc://{path}"


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def start_worker(address: str, log_dir: Path, *extra: str, ready_timeout: float = 60.0) -> WorkerProc:
    """Start `python -m slipstream.cli worker` and wait for its 'worker_ready' log line."""
    args = [sys.executable, "-m", "slipstream.cli", "worker", "--bind", address, "--heartbeat", "0.2"]
    for k, v in ENGINE.items():
        flag = f"--{k.replace('_', '-')}"
        args += ([flag] if v else []) if isinstance(v, bool) else [flag, str(v)]
    log_path = log_dir / f"worker-{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block the worker
        proc = subprocess.Popen([*args, *extra], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    w = WorkerProc(proc, address, log_path)
    if not _answers_health(w, ready_timeout):  # it binds only once ready, so an answer means ready
        w.stop()
        raise RuntimeError(f"worker did not start (rc={proc.poll()}):\n{w.log()}")
    return w


def _answers_health(w: WorkerProc, timeout: float) -> bool:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(w.address)
    deadline = time.monotonic() + timeout
    try:
        for seq in itertools.count():
            if w.proc.poll() is not None or time.monotonic() > deadline:
                return False
            sock.send(msgspec.msgpack.encode(HealthRequest(v=PROTOCOL_VERSION, seq=seq)))
            if sock.poll(200):
                return True
    finally:
        sock.close()


async def wait_pages_free(client, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = await client.stats()
        if s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0 and s["inflight"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"pages not freed: {s}")
        await asyncio.sleep(0.02)


_STUB = r'''
import sys, msgspec, zmq
sock = zmq.Context.instance().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("bound", flush=True)
received = []
while True:
    identity, data = sock.recv_multipart()
    msg = msgspec.msgpack.decode(data)
    received.append(msg.get("type"))
    if msg.get("type") == "health":
        reply = dict(type="health_reply", seq=msg["seq"], ready=True, draining=False, model="stub", pid=0,
                     heartbeat_s=0.2, max_message_bytes=1 << 20, chat_template=False, version=1)
    elif msg.get("type") == "generate" and msg.get("stream"):  # a first delta, then silence
        reply = dict(type="delta", request_id=msg["request_id"], text="x", token_ids=[120], finish_reason=None)
    elif msg.get("type") == "stats":
        reply = dict(type="stats_reply", seq=msg["seq"], stats=dict(received=received))
    else:
        continue
    sock.send_multipart([identity, msgspec.msgpack.encode(dict(v=1, msgs=[reply]))])
'''


def start_stub_worker(address: str) -> subprocess.Popen:
    """A stand-in worker that starts in a fraction of a second, for tests about the connection itself.
    It answers health, stats with {"received": [the type of every message it got]}, and a streamed
    generate with one delta that never ends; nothing else."""
    proc = subprocess.Popen([sys.executable, "-c", _STUB, address], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "bound":
        proc.kill()
        raise RuntimeError(f"stub worker did not start (rc={proc.wait()})")
    return proc


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """One default worker per test module (import this fixture into the module to use it)."""
    d = tmp_path_factory.mktemp("worker")
    w = start_worker(ipc_address(d), d)
    yield w
    w.stop()
