"""`make doctor`'s findings: one line per check of a request, ok or the problem and its fix.

    checks = [Check("partition", True, "debug: up, 4 nodes idle"),
              Check("time", False, "TIME=99-00:00:00 is over partition debug's MaxTime 7-00:00:00",
                    fix="TIME=7-00:00:00 or less, or PARTITION=... with a longer MaxTime")]
    sys.exit(report(checks))   # prints one line each; 1 when any failed

The Slurm checks live in deploy/slurm/doctor.py, the Cloud TPU ones in deploy/tpu/doctor.py, the local
launcher's in deploy/local_doctor.py. Each module's quick part (no job, no probe) is what the submit path
runs before it queues anything.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import TextIO


@dataclasses.dataclass(frozen=True)
class Check:
    name: str  # what was checked: 'partition', 'time', 'run dir on a compute node', ...
    ok: bool
    detail: str  # ok: what was found; else the problem, naming the value and what was expected
    fix: str = ""  # else: what to do about it

    def line(self) -> str:
        if self.ok:
            return f"ok    {self.name}: {self.detail}"
        return f"FAIL  {self.name}: {self.detail}" + (f". Fix: {self.fix}" if self.fix else "")


def report(checks: Iterable[Check], out: TextIO | None = None, before: str = "submitting") -> int:
    """Print each check's line as it comes; 0 when every check is ok, else 1 (with a closing count)."""
    stream = out if out is not None else sys.stdout
    failed = 0
    for check in checks:
        print(check.line(), file=stream, flush=True)
        failed += not check.ok
    if failed:
        print(f"{failed} check(s) failed: fix them before {before}", file=stream, flush=True)
    return 1 if failed else 0
