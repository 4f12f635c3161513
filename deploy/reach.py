"""Whether this machine reaches a network service at all, and a bound on every question put to one.

A client that cannot reach its service (offline, DNS, a firewall, a proxy that is down) retries for half a
minute or more before it says so (gcloud ~30 s, the Cloud Storage client ~50 s, a traceback a retry). The
doctors give each question FIRST_S; past that they look whether the service's endpoint takes a TCP connection
at all (its name resolved, within REACH_S): if not, the question is one error naming the service, the endpoint
and the fix; if it does, the service is slow, not unreachable, and the question has PATIENT_S more.

    api = Service("the Cloud TPU API (gcloud)", "https://tpu.googleapis.com/", proxied=True, fix="...")
    api.problem()                    # None, or 'tpu.googleapis.com:443: [Errno -3] Temporary failure in name ...'
    bounded(lambda: write(), api)    # write()'s result, or Unreachable (a ConfigError) within FIRST_S + REACH_S
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Generic, TypeVar

from job.core.errors import ConfigError

T = TypeVar("T")

FIRST_S = 4.0  # a question's answer, at first; a reachable service answers its clients in a second or two
REACH_S = 3.0  # the endpoint's name resolved and a TCP connection made, at most
PATIENT_S = 20.0  # then, when the endpoint does take connections: the rest of the answer, at most
DEFAULT_PORTS = {"http": 80, "https": 443}


class Background(Generic[T]):
    """`work()` in a daemon thread from now on (one that never ends is left behind and keeps nothing alive): the
    caller waits for it as long as it chooses, then takes its result or what it raised."""

    def __init__(self, work: Callable[[], T], name: str) -> None:
        self._answer: list[T] = []
        self._failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True, name=name)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._answer.append(work())
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread, by result()
            self._failure.append(exc)

    def wait(self, timeout_s: float | None) -> bool:
        """Whether it has ended, having waited at most `timeout_s` (None: however long it takes)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self) -> T:
        """What it returned, or what it raised raised here; only once wait() said it has ended."""
        if self._failure:
            raise self._failure[0]
        return self._answer[0]


@dataclasses.dataclass(frozen=True)
class Service:
    """A service a check reaches, as its client reaches it."""

    name: str  # 'the Cloud TPU API (gcloud)', 'Cloud Storage'
    url: str  # where its client connects: 'https://tpu.googleapis.com/', an override, an emulator
    proxied: bool  # its client goes through the proxy the environment names (HTTPS_PROXY, ...)
    fix: str  # how this machine gets to reach it

    def address(self) -> tuple[str, int, str]:
        """(host, port, how: '' or ' through the proxy HOST:PORT') of the connection its client opens first."""
        url = urllib.parse.urlsplit(self.url if "://" in self.url else f"http://{self.url}")
        host, port = url.hostname or "", url.port or DEFAULT_PORTS.get(url.scheme, 443)
        proxy = urllib.request.getproxies().get(url.scheme) if self.proxied else None
        if proxy and not urllib.request.proxy_bypass(host):
            via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            return via.hostname or "", via.port or 80, f" through the proxy {via.hostname}:{via.port or 80}"
        return host, port, ""

    def problem(self, bound_s: float = REACH_S) -> str | None:
        """None when its endpoint (or its proxy) takes a TCP connection within `bound_s`; else why not, in a line."""
        host, port, via = self.address()
        where = f"{host}:{port}{via}"

        def connect() -> str | None:
            try:
                socket.create_connection((host, port), timeout=bound_s).close()
                return None
            except OSError as exc:  # name resolution, refused, unreachable, timed out
                return f"cannot reach {where}: {exc.strerror or exc}"

        attempt = Background(connect, name=f"reach-{host}")  # resolving a name may not time out
        if attempt.wait(bound_s):
            return attempt.result()
        return f"cannot reach {where}: no connection within {bound_s:g} s"


class Unreachable(ConfigError):
    """A question `service` did not answer: unreachable from this machine, or silent for too long."""

    def __init__(self, service: Service, waited_s: float, found: str) -> None:
        super().__init__(service.name, expected=f"an answer within {waited_s:g} s", found=f"none: {found}",
                         fix=service.fix)
        self.service = service


def silent(service: Service) -> str:
    """What `found` says of a service whose endpoint takes connections but which did not answer."""
    host, port, via = service.address()
    return f"{host}:{port}{via} takes connections, but no answer came"


def bounded(ask: Callable[[], T], service: Service) -> T:
    """`ask()` run in a daemon thread (left behind if it does not end: it keeps nothing alive), its result within
    FIRST_S, else Unreachable once `service` proves unreachable, or after PATIENT_S more when it is reachable."""
    asked = Background(ask, name=f"bounded-{service.name}")
    if not asked.wait(FIRST_S):
        problem = service.problem()
        if problem is not None:
            raise Unreachable(service, FIRST_S, problem)
        if not asked.wait(PATIENT_S):
            raise Unreachable(service, FIRST_S + PATIENT_S, silent(service))
    return asked.result()


__all__ = ["FIRST_S", "PATIENT_S", "REACH_S", "Background", "Service", "Unreachable", "bounded", "silent"]
