"""Shared test machinery.

Tiers: a test whose engine is absent (no Slurm, no podman) skips with the
reason; with JOB_REQUIRE_ALL_TIERS=1 (CI sets it) every skip is a failure,
so a green CI run proves every tier ran.
"""

from __future__ import annotations

import os

# In-process unit tests see 8 CPU devices; must precede any jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import logging  # noqa: E402

import pytest  # noqa: E402

REQUIRE_ALL_TIERS = os.environ.get("JOB_REQUIRE_ALL_TIERS") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ANN201
    outcome = yield
    report = outcome.get_result()
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


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ARG001
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
