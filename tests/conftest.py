"""Shared test machinery.

Tiers: a test whose engine is absent (no Slurm, no podman) skips with the
reason; with JOB_REQUIRE_ALL_TIERS=1 (CI sets it) every skip is a failure,
so a green CI run proves every tier ran.
"""

from __future__ import annotations

import os
import tempfile

# In-process unit tests see 8 CPU devices; must precede any jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if os.environ.get("JOB_TESTS_CHIP") != "1":  # the TPU tier (tests/chip) runs on the chip, and its training commands too
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gcsfs picks its client class when first imported: the Cloud Storage tier's emulator needs the plain one.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Every process the tests launch shares jax's compilation cache with process 0 (tests/site/sitecustomize.py).
os.environ.setdefault("JOB_TESTS_CACHE_KEYS", "shared")
os.environ.setdefault("JOB_TESTS_COMPILE", "fast")  # and compiles its CPU programs quickly (the same file)
# and starts warm: forked from a parent that has imported jax, flax, optax and orbax (tests/site/warmstart.py), one
# folder of parents per pytest process (a worker's own, not the one it inherited), removed at its end (the parents
# then end). JOB_TESTS_WARM= (empty) starts every process cold, as the TPU tier's (tests/chip) do.
WARM = os.path.join(tempfile.gettempdir(), f"jax-job-tests-{os.getuid()}",
                    f"warm-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}")
if os.environ.get("JOB_TESTS_CHIP") == "1":
    os.environ["JOB_TESTS_WARM"] = ""
if os.environ.get("JOB_TESTS_WARM") != "":
    os.makedirs(WARM, exist_ok=True)
    os.environ["JOB_TESTS_WARM"] = WARM
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join([_SITE, *filter(None, [os.environ.get("PYTHONPATH")])])

import fcntl  # noqa: E402
import glob  # noqa: E402
import logging  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import hypothesis  # noqa: E402
import pytest  # noqa: E402

# submitit's import runs logging.config.dictConfig, which closes every handler made so far: absl's (made when
# jax is imported) closes its stream when that is not sys.stderr at that moment. Imported first inside a test
# that captures stderr, it closed pytest's own capture file. Imported here, before any test, it closes nothing
# of pytest's, and its own handlers write to the session's streams.
import submitit  # noqa: E402, F401

from tests.gcs_emulator import Emulator, EmulatorUnavailable, emulator  # noqa: E402

if TYPE_CHECKING:
    from tests.container.conftest import Built

REQUIRE_ALL_TIERS = os.environ.get("JOB_REQUIRE_ALL_TIERS") == "1"
# hypothesis: under CI (every tier required) each property test draws the same examples on every run, so a
# failure there is the same failure when run again
hypothesis.settings.register_profile("ci", derandomize=True, database=None)
if REQUIRE_ALL_TIERS:
    hypothesis.settings.load_profile("ci")
# the TPU tier (tests/chip) needs a real chip: collected only when asked, on a TPU VM (tests/chip/conftest.py)
collect_ignore = [] if os.environ.get("JOB_TESTS_CHIP") == "1" else ["chip"]
# Tiers whose tests share one engine on this machine: the local Slurm cluster's 4 nodes, podman's image
# and store (the Slurm tier runs that image too). Under pytest-xdist workers (make test-local) only one of
# their tests runs at a time, whichever worker has it: each holds this lock from its setup to its teardown.
ONE_ENGINE = ("slurm", "container")
# A test file of another tier that runs the image too (marked `container`): it goes with those tiers' tests
# (one unit of work, the lock), so it never builds or runs the image beside them. Collection checks the list.
ENGINE_FILES = ("tests/tpu/test_pod_image.py",)
ENGINE_LOCK = Path(tempfile.gettempdir()) / f"jax-job-tests-{os.getuid()}" / "one-engine.lock"


# The order the tiers start in under workers: the engine's tests first (they run one after another, so
# they go to one worker as one unit of work, see pytest_xdist_make_scheduler), then the tiers of long files,
# the many short unit files last, filling in while the other worker ends its last long file.
TIER_ORDER = ("slurm", "container", "multiprocess", "tpu", "gcs", "unit")


def _tier_of(nodeid: str) -> str:
    parts = Path(nodeid.split("::", 1)[0]).parts
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else ""


def _tier(item: pytest.Item) -> str:
    return _tier_of(item.nodeid)


def _uses_engine(nodeid: str) -> bool:
    """One of the tests that hold ENGINE_LOCK and make the engine's one unit of work."""
    return _tier_of(nodeid) in ONE_ENGINE or nodeid.split("::", 1)[0] in ENGINE_FILES


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tiers in TIER_ORDER (a stable sort: each file's tests stay together and in their order); a test marked
    `container` outside the engine's tiers must be in ENGINE_FILES."""
    items.sort(key=lambda item: TIER_ORDER.index(_tier(item)) if _tier(item) in TIER_ORDER else len(TIER_ORDER))
    unlisted = sorted({item.nodeid.split("::", 1)[0] for item in items
                       if item.get_closest_marker("container") and not _uses_engine(item.nodeid)})
    if unlisted:
        raise pytest.UsageError(f"tests/conftest.py: expected every test marked container in a tier of ONE_ENGINE "
                                f"or in ENGINE_FILES, found {unlisted}. Fix: add them to ENGINE_FILES")


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # a hook of pytest-xdist: absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 - xdist's own types
    """`--dist loadfile` (make test-local), with every test of the engine (_uses_engine) in one unit of work: they hold
    ENGINE_LOCK one at a time anyway, and a worker that took one of their files while the other worker held
    the lock would wait idle. Units are handed out in collection order (TIER_ORDER), not by size."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class EngineAsOneUnit(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "one engine" if _uses_engine(nodeid) else super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return EngineAsOneUnit(config, log)


# The CPU time each phase of a test took: its pytest process's and that of every process it started and waited
# for (and theirs, as each waited for its own), not the Slurm or podman daemons' processes. Under two workers
# on two cores the suite is bound by the CPU, so this, not the wall time, says what a test costs the run.
CPU_MARK = pytest.StashKey[float]()
CPU_PROPERTY = "cpu_s"
TEST_CPU = pytest.StashKey[float]()
TEST_CPU_PROPERTY = "test_cpu_s"  # setup, call and teardown together


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and of its children it waited for, so far, and of the warm
    children that ran their programs (tests/site/warmstart.py: each parent's ledger)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _warm_cpu()


def _warm_cpu() -> float:
    total = 0.0
    for ledger in glob.glob(os.path.join(os.environ.get("JOB_TESTS_WARM") or WARM, "cpu-*")):
        try:
            total += float(Path(ledger).read_text())
        except (OSError, ValueError):  # being replaced: the next phase counts it
            continue
    return total


def pytest_unconfigure(config: pytest.Config) -> None:  # noqa: ARG001
    """This process's warm parents end once their folder is gone."""
    if os.environ.get("JOB_TESTS_WARM") == WARM:
        shutil.rmtree(WARM, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: pytest-timeout's clock starts once it holds the lock
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201, ARG001
    item.stash[CPU_MARK] = cpu_seconds()  # waiting for the lock below takes no CPU
    if "PYTEST_XDIST_WORKER" not in os.environ or not _uses_engine(item.nodeid):
        yield
        return
    ENGINE_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with ENGINE_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ANN201
    outcome = yield
    report = outcome.get_result()
    if CPU_MARK in item.stash:  # this phase's CPU, since the last phase's report (a new list: not the item's)
        now = cpu_seconds()
        report.user_properties = [*report.user_properties, (CPU_PROPERTY, now - item.stash[CPU_MARK])]
        item.stash[TEST_CPU] = item.stash.get(TEST_CPU, 0.0) + now - item.stash[CPU_MARK]
        item.stash[CPU_MARK] = now
        if call.when == "teardown":  # the whole test's, on the report junit's XML keeps (python -m tests.costs)
            report.user_properties = [*report.user_properties, (TEST_CPU_PROPERTY, item.stash[TEST_CPU])]
    if REQUIRE_ALL_TIERS and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, but JOB_REQUIRE_ALL_TIERS=1 requires every tier: {reason}"


@pytest.fixture(autouse=True)
def _root_logging_restored() -> object:
    """Entry points call logging.basicConfig: a handler bound to one test's captured stderr
    must not outlive that test (later tests would get "--- Logging error ---" tracebacks)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


# The CPU image, built once per session: the container tier runs it with podman, the Slurm tier
# submits it to the local cluster (CONTAINER_RUNTIME=podman). The helpers live with the container tier.
@pytest.fixture(scope="session")
def podman_env() -> dict[str, str]:
    from tests.container.conftest import HERE, engine_env

    env = engine_env()
    needed = ("podman", "runc") if env["CONTAINERS_CONF"] == str(HERE / "containers.conf") else ("podman",)
    missing = [tool for tool in needed if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {' and no '.join(missing)}: the container tier needs it "
                    "(apt-get install podman runc catatonit mmdebstrap)")
    probe = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"],
                           env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail(f"podman does not work here (CONTAINERS_CONF={env['CONTAINERS_CONF']}): {probe.stderr.strip()}")
    return env


@pytest.fixture(scope="session")
def base_image(podman_env: dict[str, str], pytestconfig: pytest.Config) -> str:
    """The Dockerfile's default base, made locally when it is not there (root + mmdebstrap)."""
    from tests.container import standin
    from tests.container.conftest import figure

    if standin.existing_label(podman_env) is None and (os.geteuid() != 0 or shutil.which("mmdebstrap") is None):
        pytest.skip(f"no {standin.NAME} and no way to make one: needs root and mmdebstrap "
                    "(apt-get install mmdebstrap)")
    name, seconds = standin.ensure(podman_env)
    if seconds is not None:
        figure(pytestconfig, "stand-in base (mmdebstrap | podman import)", seconds)
    return name


@pytest.fixture(scope="session")
def cpu_image(base_image: str, podman_env: dict[str, str], pytestconfig: pytest.Config) -> Built:
    """The real CPU image, built from this checkout (the layer cache may make it quick)."""
    from tests.container.conftest import ROOT, TAG, build_image, figure

    built = build_image(ROOT, TAG, base_image, podman_env)
    figure(pytestconfig, "CPU image build", built.seconds)
    return built


# The Cloud Storage tier and the TPU tier's bucket tests share one emulator fixture.
@pytest.fixture
def gcs() -> Iterator[Emulator]:
    """A fresh, empty emulator holding the bucket gs://job-test; its `.env` is for the processes a test starts."""
    try:
        with emulator() as started:
            yield started
    except EmulatorUnavailable as exc:
        pytest.skip(f"no Cloud Storage emulator: {exc}")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ARG001
    """Each tier's time (setup, call and teardown of its tests), then the fault matrix's figures."""
    _tier_times(terminalreporter)
    _fault_matrix(terminalreporter)


def _tier_times(terminalreporter) -> None:  # noqa: ANN001 - pytest's TerminalReporter
    """Each tier's wall time and CPU time (CPU_MARK's), summed over its tests' phases and the workers."""
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    tests: dict[str, set[str]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            nodeid = getattr(report, "nodeid", "")
            if not nodeid.startswith("tests/") or not hasattr(report, "duration"):
                continue
            tier = nodeid.split("/")[1] if nodeid.count("/") > 1 else "tests"
            seconds[tier] = seconds.get(tier, 0.0) + report.duration
            cpu[tier] = cpu.get(tier, 0.0) + dict(getattr(report, "user_properties", [])).get(CPU_PROPERTY, 0.0)
            tests.setdefault(tier, set()).add(nodeid)
    if not seconds:
        return
    terminalreporter.section("time per tier (its tests' time, summed over the workers; CPU: theirs and their "
                             "processes')")
    for tier in sorted(seconds, key=seconds.get, reverse=True):
        terminalreporter.write_line(f"{tier:<14} {seconds[tier]:7.0f} s  {cpu[tier]:7.0f} s CPU  "
                                    f"{len(tests[tier]):5d} tests")
    terminalreporter.write_line(f"{'all':<14} {sum(seconds.values()):7.0f} s  {sum(cpu.values()):7.0f} s CPU  "
                                f"{sum(map(len, tests.values())):5d} tests")


def _fault_matrix(terminalreporter) -> None:  # noqa: ANN001 - pytest's TerminalReporter
    """The fault matrix's measured figures (tests/multiprocess/test_faults.py), one line per case."""
    rows = []
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            props = dict(getattr(report, "user_properties", []))
            if getattr(report, "when", "") == "call" and "fault" in props:
                rows.append((outcome, props))
    if not rows:
        return
    terminalreporter.section("fault matrix: time from the fault to the end of the whole job")
    for outcome, p in rows:
        terminalreporter.write_line(
            f"{p['fault']:<45} {p.get('exit_s', '?'):>6} s  exit {p.get('code', '?'):<4} "
            f"resumed from step {p.get('resumed_from', '-')}  {outcome}"
        )
