"""Is an address free to listen on? Asked before a worker or server loads its model, so a taken
address is one error line at once, not a failure (or a silent takeover) a minute later.

ZMQ's ipc bind replaces a socket file another live worker is serving: the old worker keeps running
and no client reaches it again. So an existing ipc file is probed with a plain connect: answered,
it is live (refused); refused, it is a stale file a worker that died left behind (bound over).
"""
from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from slipstream.errors import AddressInUseError


def ipc_path(address: str) -> Path | None:
    """The socket file of an ipc:// address, else None."""
    return Path(address[len("ipc://"):]) if address.startswith("ipc://") else None


def _ipc_live(path: Path) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:  # refused (stale file), not a socket, no permission: ZMQ's bind says the rest
            return False
    return True


def tcp_port_free(host: str, port: int) -> bool:
    """Whether a listener could bind host:port now (SO_REUSEADDR, as uvicorn and ZMQ bind: a port left in
    TIME_WAIT by a process that exited counts as free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror:
        return True  # an unknown host: the bind itself reports it
    fam, kind, proto, _, addr = infos[0]
    with socket.socket(fam, kind, proto) as s:
        if os.name != "nt":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
    return True


def check_bind_address(address: str, flag: str = "--bind") -> None:
    """Raise AddressInUseError when a live process serves the ZMQ address `address` (ipc:// or tcp://)."""
    path = ipc_path(address)
    if path is not None:
        if _ipc_live(path):
            raise AddressInUseError(f"{flag} {address}: a live process (another worker?) is serving this socket; "
                                    "stop it or choose another path", param=flag)
        return
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if not port.isdigit():
            return  # tcp://*:* and the like: ZMQ picks the port
        host = host.strip("[]")
        if not tcp_port_free("" if host in ("*", "0.0.0.0") else host, int(port)):
            raise AddressInUseError(f"{flag} {address}: the port is in use by another process; stop it or "
                                    "choose another port", param=flag)


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Raise AddressInUseError when host:port is taken (the HTTP server's listen address)."""
    if port and not tcp_port_free("" if host in ("0.0.0.0",) else host, port):
        raise AddressInUseError(f"{flag} {port}: address {host}:{port} is already in use by another process; "
                                "stop it or choose another port", param=flag)
