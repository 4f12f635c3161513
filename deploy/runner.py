"""The one way this package runs external commands (sbatch, scontrol, gcloud, ...).

Commands are argv lists, never shell strings. A dry run prints each command
(shell-quoted, so it can be pasted) instead of running it. Tests substitute a
subclass that records each argv, to check it exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)


def shell_words(text: str) -> tuple[str, ...]:
    """An argparse type: one shell-style string (make's ARGS) -> the words, as a POSIX shell splits them."""
    try:
        return tuple(shlex.split(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected shell-style words (quotes balanced), found {text!r} ({e}). Fix: close the quote") from e


@dataclasses.dataclass
class Runner:
    dry_run: bool = False  # print commands instead of running them

    def which(self, program: str) -> str | None:
        return shutil.which(program)

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        capture: bool = False,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        mutating: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv`. In a dry run, commands that change something are printed, not run;
        read-only ones (``mutating=False``: status queries) still run."""
        argv = [str(a) for a in argv]
        if self.dry_run and mutating:
            print(shlex.join(argv), file=sys.stdout, flush=True)
            return subprocess.CompletedProcess(argv, 0, "", "")
        log.debug("running %s", shlex.join(argv))
        return subprocess.run(
            argv, check=check, text=True, timeout=timeout, env=None if env is None else dict(env),
            stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None,
        )

    def run_echoing_stderr(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None
                           ) -> subprocess.CompletedProcess[str]:
        """Run `argv` to its end, its stderr copied to ours line by line as it comes and also returned (srun's own
        messages say which task failed where); stdout passes through."""
        argv = [str(a) for a in argv]
        if self.dry_run:
            print(shlex.join(argv), file=sys.stdout, flush=True)
            return subprocess.CompletedProcess(argv, 0, "", "")
        log.debug("running %s", shlex.join(argv))
        lines: list[str] = []
        with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, errors="replace",
                              env=None if env is None else dict(env)) as proc:
            assert proc.stderr is not None
            for line in proc.stderr:
                sys.stderr.write(line)
                sys.stderr.flush()
                lines.append(line)
        return subprocess.CompletedProcess(argv, proc.returncode, None, "".join(lines))
