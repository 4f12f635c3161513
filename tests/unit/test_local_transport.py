"""The node-local tier's peer copies (job/runs/local_transport.py): a server that serves the run's own processes only.
A peer with the run's secret puts and gets a sealed file; a connection without it reads nothing and changes nothing,
whatever it sends; a put larger than that process's file can be is refused before a byte is stored; bytes that do
not match their signed checksum are dropped; a server without the secret is not believed."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
from pathlib import Path

import pytest

from job.runs import local_transport as transport
from job.runs.local_format import DIGEST

SECRET = bytes(range(32))
BOUND = 1 << 16  # the most bytes the test's process 3 may put


def _sealed(path: Path, payload: bytes) -> Path:
    """A file as the tier seals one: its bytes, then their SHA-256."""
    path.write_bytes(payload + hashlib.sha256(payload).digest())
    return path


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (temporary ones too) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    folder = tmp_path / "held"
    folder.mkdir()
    received: list[int] = []
    served = transport.Server("127.0.0.1", folder, SECRET, bounds=lambda p: BOUND if p in (0, 3) else None,
                              received=received.append)
    served.received_steps = received  # type: ignore[attr-defined]
    yield served
    served.close()


def _raw(address: str, data: bytes) -> bytes:
    """What the server answers a client that sends `data` as it is (no secret), until it closes."""
    host, port = address.rsplit(":", 1)
    got = b""
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        with contextlib.suppress(OSError):  # the server hangs up on what it will not read: then it has said all
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            while chunk := conn.recv(1 << 16):
                got += chunk
    return got


def test_the_server_listens_on_this_hosts_interface_toward_its_peers_node_only(tmp_path: Path) -> None:
    assert transport.bind_host("127.0.0.2") == "127.0.0.1"  # nodes on one machine: loopback, nothing else
    served = transport.Server(transport.bind_host("127.0.0.2"), tmp_path, SECRET, bounds=lambda p: None,
                              received=lambda step: None)
    try:
        assert served.server_address[0] == "127.0.0.1" and served.address.startswith("127.0.0.1:")
    finally:
        served.close()


def test_a_peer_with_the_secret_puts_a_file_and_gets_it_back(server: transport.Server, tmp_path: Path) -> None:
    assert server.server_address[0] == "127.0.0.1"
    sent = _sealed(tmp_path / "sent.jlt", os.urandom(5000))
    transport.send(server.address, SECRET, 4, 3, sent)
    assert (server.folder / "4" / "process-3.jlt").read_bytes() == sent.read_bytes()
    assert server.received_steps == [4]  # type: ignore[attr-defined]
    transport.fetch(server.address, SECRET, 4, 3, tmp_path / "back.jlt")
    assert (tmp_path / "back.jlt").read_bytes() == sent.read_bytes()
    with pytest.raises(FileNotFoundError):
        transport.fetch(server.address, SECRET, 4, 0, tmp_path / "none.jlt")
    assert not (tmp_path / "none.jlt").exists()


@pytest.mark.parametrize("request_line", [
    b"GET 4 3\n",  # the tier's old protocol
    b"PUT 4 3 100\n" + b"x" * 100,
    b"GET 4 3 abcd " + b"0" * 64 + b"\n",  # a guessed signature
    b"PUT 4 3 100 " + b"0" * 64 + b" abcd " + b"0" * 64 + b"\n" + b"x" * 100,
    b"PUT 4 3 " + str(1 << 40).encode() + b" " + b"0" * 64 + b" abcd " + b"0" * 64 + b"\n",  # fill the node
    b"x" * 100_000,  # no line at all
    b"",
])
def test_a_connection_without_the_secret_reads_nothing_and_changes_nothing(
        server: transport.Server, tmp_path: Path, request_line: bytes) -> None:
    transport.send(server.address, SECRET, 4, 3, _sealed(tmp_path / "sent.jlt", b"weights" * 1000))
    before = _snapshot(server.folder)
    answer = _raw(server.address, request_line)
    nonce, _, rest = answer.partition(b"\n")
    assert len(nonce) in (0, 64)  # the server's challenge (lost if it hung up on unread bytes), then no file
    assert rest in (b"", b"refused unsigned\n"), rest
    assert _snapshot(server.folder) == before  # no file added, changed or left half-written


def test_a_wrong_secret_is_refused_both_ways_and_stores_nothing(server: transport.Server, tmp_path: Path) -> None:
    sent = _sealed(tmp_path / "sent.jlt", b"weights" * 1000)
    with pytest.raises(transport.Refused, match="refused unsigned"):
        transport.send(server.address, b"not the secret" * 3, 4, 3, sent)
    assert _snapshot(server.folder) == {}
    transport.send(server.address, SECRET, 4, 3, sent)
    with pytest.raises(transport.Refused, match="without the run's secret"):
        transport.fetch(server.address, b"not the secret" * 3, 4, 3, tmp_path / "back.jlt")
    assert not (tmp_path / "back.jlt").exists()


def test_a_request_replayed_on_another_connection_is_refused(server: transport.Server, tmp_path: Path) -> None:
    """A signature holds for its connection's challenge only: one recorded on the wire opens nothing later."""
    transport.send(server.address, SECRET, 4, 3, _sealed(tmp_path / "sent.jlt", b"weights" * 1000))
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn, conn.makefile("rb") as reader:
        nonce = reader.readline().strip().decode()
        line = f"GET 4 3 cafe {transport._mac(SECRET, nonce, 'GET', 4, 3, 'cafe')}\n".encode()
        conn.sendall(line)
        assert b"weights" in reader.read()  # on its own connection: served
    answer = _raw(server.address, line)
    assert answer.endswith(b"refused unsigned\n") and b"weights" not in answer


def test_a_put_larger_than_the_processs_file_or_of_an_unknown_process_is_refused_before_a_byte_is_stored(
        server: transport.Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = _sealed(tmp_path / "big.jlt", os.urandom(BOUND))  # BOUND + DIGEST bytes: one digest too many
    seen: list[int] = []
    real_receive = transport._receive
    monkeypatch.setattr(transport, "_receive", lambda reader, size, *rest: seen.append(size) or real_receive(
        reader, size, *rest))
    with pytest.raises(transport.Refused, match=f"refused size {BOUND + DIGEST}"):
        transport.send(server.address, SECRET, 4, 3, big)
    with pytest.raises(transport.Refused, match="refused size"):
        transport.send(server.address, SECRET, 4, 7, _sealed(tmp_path / "small.jlt", b"x" * 10))  # no process 7
    assert seen == [] and _snapshot(server.folder) == {}


def test_bytes_that_do_not_match_their_signed_checksum_are_dropped(server: transport.Server, tmp_path: Path) -> None:
    """A file changed after it was sealed (or on the wire): the receiver hashes what comes and keeps none of it."""
    damaged = _sealed(tmp_path / "damaged.jlt", b"weights" * 1000)
    data = bytearray(damaged.read_bytes())
    data[10] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(ConnectionError):
        transport.send(server.address, SECRET, 4, 3, damaged)
    assert _snapshot(server.folder) == {}
    assert any("do not match their signed checksum" in p for p in server.problems), server.problems


def test_a_server_without_the_secret_is_not_believed(tmp_path: Path) -> None:
    """A stranger on a dead peer's port: whatever it answers, the fetch fails and writes nothing."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"0" * 64 + b"\n")
            conn.recv(1024)
            payload = b"poisoned" * 100
            digest = hashlib.sha256(payload).hexdigest()
            conn.sendall(f"{len(payload) + DIGEST} {digest} {'0' * 64}\n".encode() + payload
                         + hashlib.sha256(payload).digest())

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(transport.Refused, match="without the run's secret"):
        transport.fetch(f"127.0.0.1:{port}", SECRET, 4, 3, tmp_path / "got.jlt")
    thread.join(timeout=10)
    listener.close()
    assert not (tmp_path / "got.jlt").exists() and list(tmp_path.iterdir()) == []


def test_the_secret_comes_from_process_0_through_the_key_value_store() -> None:
    store: dict[str, str] = {}

    class Store:
        def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
            store[key] = value

        def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
            return store[key]

    made = transport.shared_secret(Store(), 0, "k")
    assert len(made) == 32 and transport.shared_secret(Store(), 1, "k") == made
    assert transport.shared_secret(None, 0, "k") != made  # one process: its own, shared with no one
