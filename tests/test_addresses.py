"""A taken address is one `slipstream: error:` line before any model loads: `worker --bind` on an ipc
socket or tcp port a live process serves (ZMQ's ipc bind would silently take the socket over), and
`serve --port` on a port in use (uvicorn would fail after the model loaded, exit status 3). A worker
removes its ipc socket file when it exits (test_worker_lifecycle, SIGTERM: SIGINT takes the same handler);
a stale file a dead worker left is bound over."""
import socket

import pytest
from worker_util import ipc_address

from slipstream import cli
from slipstream.api.addresses import check_bind_address, check_port_free
from slipstream.errors import AddressInUseError


@pytest.fixture
def listening_tcp():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def listening_ipc(tmp_path):
    address = ipc_address(tmp_path)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(address[len("ipc://"):])
        s.listen()
        yield address


def no_model_loads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model loaded before the address was checked")

    monkeypatch.setattr("slipstream.api.engine.Engine.start", refuse)
    monkeypatch.setattr("slipstream.commands.serve.build_backend", refuse)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slipstream: error: "), err
    return err[0]


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_worker_refuses_an_address_a_live_process_serves(kind, listening_ipc, listening_tcp, capsys, monkeypatch):
    no_model_loads(monkeypatch)
    address = listening_ipc if kind == "ipc" else f"tcp://127.0.0.1:{listening_tcp}"
    assert cli.main(["worker", "--bind", address, "--model", "tiny-random", "--log-level", "error"]) == 2
    assert address in one_error_line(capsys)


def test_serve_refuses_a_port_in_use_before_loading(listening_tcp, capsys, monkeypatch):
    pytest.importorskip("uvicorn")
    no_model_loads(monkeypatch)
    assert cli.main(["serve", "--model", "tiny-random", "--port", str(listening_tcp), "--log-level", "error"]) == 2
    assert f"127.0.0.1:{listening_tcp} is already in use" in one_error_line(capsys)
    for host in ("127.0.0.1", "0.0.0.0"):  # every interface includes the taken one
        with pytest.raises(AddressInUseError):
            check_port_free(host, listening_tcp)


def test_free_and_stale_addresses_pass(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port_free("127.0.0.1", port)
    check_bind_address(f"tcp://127.0.0.1:{port}")
    check_bind_address("tcp://127.0.0.1:*")
    stale = ipc_address(tmp_path)
    with socket.socket(socket.AF_UNIX) as s:  # a dead worker's file: nobody answers on it
        s.bind(stale[len("ipc://"):])
    check_bind_address(stale)
    check_bind_address(ipc_address(tmp_path / "none"))
