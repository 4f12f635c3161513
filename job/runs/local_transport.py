"""Peer copies of the node-local tier's files (job/runs/local_tier.py), served to the run's own processes only.

Each process of a run that spans nodes runs a small TCP server. It listens only on the address of this host's
interface toward its peer's node (the network the run's processes reach each other over; no server at all when
they all run on one node), and answers only requests signed with the run's secret: 32 random bytes that process 0
makes at every start and hands to the others through the coordination service's key-value store, kept in memory
only (never in argv, a log, provenance or a file). A connection goes:

    server -> client   NONCE                                    (32 random bytes, hex; fresh for the connection)
    client -> server   PUT STEP PROCESS SIZE DIGEST CNONCE MAC  or  GET STEP PROCESS CNONCE MAC
    PUT: server -> client  go | refused REASON   then client -> server the SIZE bytes, and server -> client ok
    GET: server -> client  SIZE DIGEST MAC | none | refused REASON, then the SIZE bytes

MAC is HMAC-SHA256 under the secret of the line's own words after both nonces, so a request without the secret,
or one replayed on another connection, is refused before the server reads a byte more or opens a file; the GET
answer's MAC (over the client's nonce) proves the server holds the secret too. A PUT larger than that process's
file can be (its `size_bound`, given by the tier) or larger than the folder has room for is refused before a byte
is stored. The received bytes are hashed as they arrive: unless they end with their own SHA-256 and it is the
signed DIGEST, the file is dropped.

Why a listener and not jax's collectives: a copy through collectives would hold every process in the loop while
the bytes move (a device-to-device exchange of the whole state at every local save, with a device buffer as
large as the largest piece sent), and on a restart the spare's fetch would need every process's part in one
collective; here the send runs on a thread while training goes on, and costs no device memory.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import secrets
import shutil
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from job.core import renamed
from job.runs.local_format import DIGEST, shard_file

TIMEOUT_S = 120  # a peer that does not answer within this is taken as gone
HELLO_TIMEOUT_S = 10  # a connection that does not send a signed request within this is closed
CHUNK = 8 << 20  # bytes read from a connection at a time
LINE = 512  # the longest request or answer line, in bytes
ROOM_FACTOR = 2.0  # a PUT needs this many times its bytes free in the folder's file system


class KeyValue(Protocol):
    """What the tier uses of jax's coordination service client (tests give a stand-in)."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = ...) -> None: ...

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...


class Refused(ConnectionError):
    """A peer refused a request (unsigned, too large, no room), or answered without the run's secret."""


def shared_secret(client: KeyValue | None, me: int, key: str) -> bytes:
    """The run's secret: made by process 0, read by the others from the key-value store (blocking)."""
    if client is None:
        return secrets.token_bytes(32)
    if me == 0:
        made = secrets.token_bytes(32)
        client.key_value_set(key, made.hex(), allow_overwrite=True)
        return made
    return bytes.fromhex(client.blocking_key_value_get(key, TIMEOUT_S * 1000))


def bind_host(toward: str) -> str:
    """The address of this host's interface toward the host `toward` (a peer's node name or address): the network
    the run's processes reach each other over, and the only one the server listens on."""
    family, _, _, _, address = socket.getaddrinfo(toward, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # a UDP connect sends nothing: it picks the route
        probe.connect(address)
        return str(probe.getsockname()[0])


def _mac(secret: bytes, *words: object) -> str:
    return hmac.new(secret, " ".join(map(str, words)).encode(), hashlib.sha256).hexdigest()


def _line(reader: io.BufferedIOBase) -> list[str]:
    raw = reader.readline(LINE)
    if not raw.endswith(b"\n"):
        raise Refused(f"expected a line of at most {LINE} bytes, found {raw[:40]!r}")
    return raw.decode("ascii", "replace").split()


def _receive(reader: io.BufferedIOBase, size: int, digest: bytes, path: Path) -> None:
    """`size` bytes into `path`, atomically, hashed as they come: kept only when they end with their own SHA-256
    and it is `digest` (the one the signed request named)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    hashed, tail, left = hashlib.sha256(), b"", size
    try:
        with open(tmp, "wb") as f:
            while left:
                chunk = reader.read(min(left, CHUNK))
                if not chunk:
                    raise ConnectionError(f"the connection closed with {left} of {size} bytes still to come")
                f.write(chunk)
                left -= len(chunk)
                body = tail + chunk  # the last DIGEST bytes are the file's own digest, not hashed
                hashed.update(body[:max(0, len(body) - DIGEST)])
                tail = body[max(0, len(body) - DIGEST):]
        if size < DIGEST or not hmac.compare_digest(hashed.digest(), tail) or not hmac.compare_digest(tail, digest):
            raise Refused(f"the bytes received for {path.name} do not match their signed checksum")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class _Handler(socketserver.StreamRequestHandler):
    server: Server
    timeout = HELLO_TIMEOUT_S

    def handle(self) -> None:
        with_secret, nonce = self.server.secret, secrets.token_hex(32)
        self.wfile.write(f"{nonce}\n".encode())
        try:
            words = _line(self.rfile)
        except (Refused, OSError):
            return
        if len(words) < 2 or not hmac.compare_digest(words[-1], _mac(with_secret, nonce, *words[:-1])):
            self.wfile.write(b"refused unsigned\n")  # nothing read further, no file opened
            return
        self.connection.settimeout(TIMEOUT_S)
        try:
            if words[0] == "PUT" and len(words) == 7:
                self.put(int(words[1]), int(words[2]), int(words[3]), bytes.fromhex(words[4]))
            elif words[0] == "GET" and len(words) == 5:
                self.get(int(words[1]), int(words[2]), words[3])
            else:
                self.wfile.write(b"refused unknown request\n")
        except (Refused, OSError, ValueError) as exc:
            self.server.problems.append(f"{type(exc).__name__}: {exc}")

    def put(self, step: int, process: int, size: int, digest: bytes) -> None:
        bound = self.server.bounds(process)
        free = shutil.disk_usage(self.server.folder).free
        if bound is None or step < 0 or not 0 < size <= bound:
            self.wfile.write(f"refused size {size} (process {process}'s files hold at most {bound})\n".encode())
        elif free < ROOM_FACTOR * size:
            self.wfile.write(f"refused no room ({free} bytes free)\n".encode())
        else:
            self.wfile.write(b"go\n")
            self.wfile.flush()
            _receive(self.rfile, size, digest, shard_file(self.server.folder, step, process))
            self.server.received(step)
            self.wfile.write(b"ok\n")

    def get(self, step: int, process: int, cnonce: str) -> None:
        path = shard_file(self.server.folder, step, process)
        if not path.exists():
            self.wfile.write(b"none\n")
            return
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(-DIGEST, os.SEEK_END)
            digest = f.read(DIGEST).hex()
            f.seek(0)
            self.wfile.write(f"{size} {digest} {_mac(self.server.secret, cnonce, size, digest)}\n".encode())
            self.wfile.flush()
            self.connection.sendfile(f)


class Server(socketserver.ThreadingTCPServer):
    """This process's server: takes its peers' files into `folder` and gives them back, for signed requests only.
    `bounds(process)`: the most bytes that process's file can have (None: no such process); `received(step)`: called
    after a file is stored (the tier prunes old steps)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, folder: Path, secret: bytes, bounds: Callable[[int], int | None],
                 received: Callable[[int], None]) -> None:
        self.folder, self.secret, self.bounds, self.received = folder, secret, bounds, received
        self.problems: list[str] = []  # what went wrong serving (a peer that hung up midway): read by tests
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, 0), _Handler)
        threading.Thread(target=self.serve_forever, name="job-local-tier", daemon=True).start()

    @property
    def address(self) -> str:
        host, port = str(self.server_address[0]), self.server_address[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def _connect(address: str, secret: bytes, *words: object) -> tuple[socket.socket, io.BufferedReader, str]:
    """A connection to the server at `address`, the request `words` sent signed; (socket, reader, client nonce)."""
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host.strip("[]"), int(port)), timeout=TIMEOUT_S)
    try:
        reader = conn.makefile("rb")
        (nonce,) = _line(reader)[:1] or [""]
        cnonce = secrets.token_hex(16)
        signed = [*map(str, words), cnonce]
        conn.sendall(f"{' '.join(signed)} {_mac(secret, nonce, *signed)}\n".encode())
    except BaseException:
        conn.close()
        raise
    return conn, reader, cnonce


def send(address: str, secret: bytes, step: int, process: int, path: Path) -> None:
    """PUT this process's sealed file of `step` to the peer at `address` (the kernel copies it: sendfile)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(-DIGEST, os.SEEK_END)
        digest = f.read(DIGEST).hex()
        f.seek(0)
        conn, reader, _ = _connect(address, secret, "PUT", step, process, size, digest)
        with conn, reader:
            answer = reader.readline(LINE).strip()
            if answer != b"go":
                raise Refused(f"{address} did not take step {step}'s file: {answer.decode(errors='replace')}")
            conn.sendfile(f)
            if reader.readline(LINE).strip() != b"ok":
                raise ConnectionError(f"{address} did not store step {step}'s file")


def fetch(address: str, secret: bytes, step: int, process: int, path: Path) -> None:
    """GET `process`'s sealed file of `step` from the process at `address` into `path` (checked on arrival)."""
    conn, reader, cnonce = _connect(address, secret, "GET", step, process)
    with conn, reader:
        words = _line(reader)
        if words == ["none"]:
            raise FileNotFoundError(f"{address} holds no file of process {process} at step {step}")
        if len(words) != 3 or not words[0].isdigit() or not hmac.compare_digest(
                words[2], _mac(secret, cnonce, words[0], words[1])):
            raise Refused(f"{address} answered without the run's secret: {' '.join(words)[:80]!r}")
        _receive(reader, int(words[0]), bytes.fromhex(words[1]), path)


__getattr__ = renamed.answer(__name__, {"HEADROOM": "ROOM_FACTOR"})  # the old name warns

__all__ = ["ROOM_FACTOR", "KeyValue", "Refused", "Server", "bind_host", "fetch", "send", "shared_secret"]
