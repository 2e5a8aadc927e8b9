"""Helpers for the serve tests: a real uvicorn server on 127.0.0.1 in a thread, or as a subprocess."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# each module that imports this one is skipped where the `serve` extra (or httpx) is missing
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
from slipstream.serve.app import create_app  # noqa: E402
from slipstream.serve.server import Server  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn (uvloop + httptools, as `slipstream serve`) on its own thread; the engine lives on its loop."""

    def __init__(self, backend, read_timeout_s: float | None = None, shutdown_timeout: float = 5, **app_kw):
        self.app = create_app(backend, **app_kw)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        http = "httptools"
        if read_timeout_s is not None:
            from slipstream.serve.read_timeout import read_timeout_protocol

            http = read_timeout_protocol(read_timeout_s)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, loop="uvloop", http=http,
                                log_level="warning", access_log=False,
                                timeout_graceful_shutdown=shutdown_timeout)
        self.server = Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def state(self):
        return self.app.state.server


class ServeProc:
    """`python -m slipstream.cli serve ...` as a subprocess, logging to a file."""

    def __init__(self, log_dir: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{time.monotonic_ns()}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "slipstream.cli", "serve", "--port", str(self.port),
                                          *args], stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"serve did not start:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


async def wait_pages_free(base_url: str, timeout: float = 10.0) -> dict:
    """Poll /health until no request is running and every KV page (of every worker) is free."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base_url) as http:
        while True:
            s = (await http.get("/health")).json()["stats"]
            if s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"pages not freed: {s}")
            await asyncio.sleep(0.02)
