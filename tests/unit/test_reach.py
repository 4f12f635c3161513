"""deploy/reach.py and the doctor's gcloud questions: a service that cannot be reached is one error naming it within
seconds, a reachable one that is slow gets more time, and nothing left running keeps a process alive."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from deploy import reach
from deploy.tpu import doctor, gcloud
from tests.doubles import RecordingRunner
from tests.launching import ROOT

CLOSED = "http://127.0.0.1:9"  # nothing listens: refused at once


@pytest.fixture
def listening() -> Iterator[str]:
    """The URL of a port that takes connections and never answers a request."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"http://127.0.0.1:{server.getsockname()[1]}/"


def service(url: str, proxied: bool = False) -> reach.Service:
    return reach.Service("the thing", url, proxied=proxied, fix="reach it")


def test_an_endpoint_that_takes_connections_is_reachable_and_a_closed_one_names_itself(listening: str) -> None:
    assert service(listening).problem() is None
    assert service(CLOSED).problem() == "cannot reach 127.0.0.1:9: Connection refused"
    assert service("https://no-such-host.invalid/").problem().startswith("cannot reach no-such-host.invalid:443: ")


def test_a_proxied_service_is_reached_through_the_environments_proxy_unless_its_host_is_bypassed(
        listening: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", CLOSED)
    monkeypatch.setenv("https_proxy", CLOSED)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert service("https://tpu.googleapis.com/", proxied=True).problem() == (
        "cannot reach 127.0.0.1:9 through the proxy 127.0.0.1:9: Connection refused")
    assert service("https://storage.googleapis.com", proxied=False).address() == ("storage.googleapis.com", 443, "")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    assert service(listening.replace("http:", "https:"), proxied=True).problem() is None


def test_a_bounded_question_to_an_unreachable_service_is_one_error_at_its_first_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reach, "FIRST_S", 0.2)
    began = time.monotonic()
    with pytest.raises(reach.Unreachable) as raised:
        reach.bounded(lambda: time.sleep(60), service(CLOSED))
    assert time.monotonic() - began < 5
    assert str(raised.value) == ("the thing: expected an answer within 0.2 s, found 'none: cannot reach 127.0.0.1:9: "
                                 "Connection refused'. Fix: reach it")
    assert raised.value.service == service(CLOSED)


def test_a_reachable_service_that_is_slow_gets_its_answer_and_one_that_never_answers_is_named_silent(
        listening: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reach, "FIRST_S", 0.1)
    assert reach.bounded(lambda: time.sleep(0.5) or "written", service(listening)) == "written"
    monkeypatch.setattr(reach, "PATIENT_S", 0.3)
    with pytest.raises(reach.Unreachable, match=r"expected an answer within 0.4 s, found 'none: 127.0.0.1:\d+ takes "
                                                r"connections, but no answer came'"):
        reach.bounded(lambda: time.sleep(60), service(listening))
    with pytest.raises(ValueError, match="its own"):  # the question's own error, raised where it was asked
        reach.bounded(lambda: (_ for _ in ()).throw(ValueError("its own")), service(listening))


def test_a_question_left_running_does_not_keep_the_process_alive() -> None:
    program = ("import time; from deploy import reach; reach.FIRST_S = 0.1\n"
               "try: reach.bounded(lambda: time.sleep(600), reach.Service('x', 'http://127.0.0.1:9', False, 'f'))\n"
               "except reach.Unreachable as e: print(e.service.name)")
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "x\n"), proc.stderr
    assert time.monotonic() - began < 30


@dataclasses.dataclass
class SlowGcloud(RecordingRunner):
    """gcloud whose first `slow` answers take longer than the question's bound; each call's timeout recorded."""

    slow: int = 1
    timeouts: list[float | None] = dataclasses.field(default_factory=list)

    def run(self, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:  # type: ignore[override]
        done = super().run(argv, **kwargs)
        self.timeouts.append(kwargs.get("timeout"))  # type: ignore[arg-type]
        if len(self.calls) <= self.slow:
            raise subprocess.TimeoutExpired(list(argv), float(kwargs["timeout"]))  # type: ignore[arg-type]
        return done


def test_a_gcloud_question_past_its_bound_is_asked_again_when_the_api_is_reachable_else_it_names_the_api(
        listening: str, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["gcloud", "compute", "tpus", "tpu-vm", "versions", "list"]
    monkeypatch.setenv(doctor.API_OVERRIDE, listening)
    runner = SlowGcloud(responses={tuple(argv): (0, "tpu-vm-base\n")})
    assert doctor._ask(runner, argv).stdout == "tpu-vm-base\n"
    assert runner.timeouts == [reach.FIRST_S, reach.PATIENT_S]
    monkeypatch.setenv(doctor.API_OVERRIDE, f"{CLOSED}/")
    runner = SlowGcloud()
    with pytest.raises(reach.Unreachable, match=r"^gcloud \(the Cloud TPU API\): expected an answer within 4 s, found "
                                                r"'none: cannot reach 127.0.0.1:9: Connection refused'\. Fix: "):
        doctor._ask(runner, argv)
    assert len(runner.calls) == 1  # gcloud itself was stopped at the bound: asked once
    with pytest.raises(doctor.ConfigError, match=r"gcloud: expected an answer within 24 s \(from its own "
                                                 r"configuration\), found 'none: gcloud auth list did not end'"):
        doctor._ask(SlowGcloud(), gcloud.active_account(), api=False)  # no network involved: one bound, no probe


def test_background_work_gives_its_result_or_raises_its_error_here_and_a_stuck_one_is_left_behind() -> None:
    done = reach.Background(lambda: "answer", name="quick")
    assert done.wait(5) and done.result() == "answer"
    broken = reach.Background(lambda: 1 / 0, name="broken")
    assert broken.wait(5)
    with pytest.raises(ZeroDivisionError):
        broken.result()
    release = threading.Event()
    began = time.monotonic()
    stuck = reach.Background(release.wait, name="stuck")
    assert not stuck.wait(0.2) and time.monotonic() - began < 2  # the caller goes on; the thread is a daemon
    release.set()
    assert stuck.wait(5) and stuck.result() is True
