"""`make tpu-pod DRY_RUN=1` where gcloud cannot answer: no gcloud on PATH, no active account, or no project.

    runner, known = preview.runner_for(cfg, runner)   # known: the quick part's answers so far; None: not asked

A dry run prints the commands that change something and still asks gcloud its read-only questions (the account,
the project, what the zone offers, the slice's state). Without credentials it cannot: then `Offline` prints every
command the run would send, each read-only question as a `# not asked: gcloud ...` line in its place, and takes
every answer to be "not found", so the preview is that of a slice that does not exist yet. The first lines say
why, which checks were skipped and which values gcloud would supply (shown as <PLACEHOLDERS>); the exit status is
the dry run's, 0.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import subprocess
from collections.abc import Mapping, Sequence

from deploy.runner import Runner
from deploy.tpu import doctor
from deploy.tpu.config import TpuConfig
from job.errors import ConfigError

log = logging.getLogger("deploy.tpu")

NOT_ASKED = 1  # the exit status a question that was not asked answers with (its stderr says NOT_FOUND)
ACCOUNT = "<ACCOUNT>"  # gcloud's active account
PROJECT = "<PROJECT>"  # gcloud's configured project (commands without --project use it)


@dataclasses.dataclass
class Offline(Runner):
    """A dry run's runner that asks gcloud nothing: changes are printed as in any dry run, and so is each read-only
    question, as a comment, answered "not found"."""

    dry_run: bool = True
    reason: str = ""  # why gcloud cannot be asked, e.g. 'no active account'

    def run(self, argv: Sequence[str], *, check: bool = True, capture: bool = False, timeout: float | None = None,
            env: Mapping[str, str] | None = None, mutating: bool = True) -> subprocess.CompletedProcess[str]:
        if mutating:
            return super().run(argv, check=check, capture=capture, timeout=timeout, env=env, mutating=True)
        argv = [str(a) for a in argv]
        print(f"# not asked: {shlex.join(argv)}", flush=True)
        return subprocess.CompletedProcess(argv, NOT_ASKED, "", f"NOT_FOUND: not asked in a dry run ({self.reason})")


def runner_for(cfg: TpuConfig, runner: Runner) -> tuple[Runner, list[str] | None]:
    """The command's runner, and the quick part's answers it already has (`doctor.preflight` asks the rest): none
    outside a dry run; in a dry run gcloud's path, the account and the project, asked here first. When gcloud cannot
    give them: an `Offline` runner and None (no read-only check is asked), after the lines that say so."""
    if not cfg.dry_run:
        return runner, []
    found = []
    for probe in doctor.QUICK[:3]:  # gcloud on PATH, the active account, the project
        try:
            found.append(probe.ask(cfg, runner))
        except ConfigError as exc:
            return _offline(cfg, f"{exc.what}: {exc.found}", exc.fix), None
    return runner, found


def _offline(cfg: TpuConfig, reason: str, fix: str) -> Offline:
    """The preview's first lines (why, the checks skipped, the placeholders), and its runner."""
    project = (f"{cfg.project} (PROJECT)" if cfg.project else
               f"{PROJECT} (commands without --project use gcloud's configured project)")
    for line in (f"dry run without gcloud's answers ({reason}; fix: {fix})",
                 f"read-only checks skipped: gcloud's account and project, whether {cfg.zone} offers {cfg.accelerator} "
                 f"and runtime version {cfg.runtime_version}, the state of slice {cfg.name} (taken as not existing)",
                 f"values gcloud would supply: the account {ACCOUNT}, the project {project}"):
        print(f"# {line}", flush=True)
    log.warning("dry run: gcloud cannot be asked (%s): the commands below assume slice %s does not exist yet",
                reason, cfg.name)
    return Offline(dry_run=True, reason=reason)
