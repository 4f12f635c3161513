"""An in-process stand-in for gcloud: records every argv and answers from a tiny state machine.

Used by the golden-file and pod-loop tests, which check the exact commands
without starting processes. (The end-to-end tests use the real simulator.)
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Sequence

from deploy.runner import Runner


@dataclasses.dataclass
class SimRunner(Runner):
    node: str | None = None  # the node's state; None = no node
    accelerator: str = "v4-32"  # the node's accelerator type
    queued: str | None = None  # the queued resource's state; None = none
    job_outcomes: list[tuple[int, str | None]] = dataclasses.field(default_factory=list)
    # ^ per follow-ssh call (worker 0's log until the job ends): (exit code, the node's state afterwards, or
    #   None to leave it); default (0, None)
    worker_job: str = "none"  # what worker 0 says of its job when asked: running, ended CODE, none (+ stopped)
    calls: list[list[str]] = dataclasses.field(default_factory=list)
    has_gcloud: bool = True
    create_errors: list[str] = dataclasses.field(default_factory=list)  # per create call: fails with this stderr
    probe_failures: int = 0  # the first N probes of worker 0 fail as a dropped ssh does (255)
    # ^ what each worker says of its ended job when asked (remote.outcome_script), per asking: its stdout lines,
    #   e.g. ["worker 0: ended 1 1700000002.0 lost a peer", "worker 2: ended 137 1700000001.0 step 7"]; default none
    worker_outcomes: list[list[str]] = dataclasses.field(default_factory=list)
    account: str | None = "tester@example.com"  # gcloud's active account; None: not logged in
    project: str | None = "fake-project"  # gcloud's configured project; None: unset
    offered_types: tuple[str, ...] = ("v4-8", "v4-16", "v4-32", "v4-64")  # what the zone offers
    offered_versions: tuple[str, ...] = ("tpu-ubuntu2204-base", "tpu-vm-base")

    def which(self, program: str) -> str | None:
        return f"/usr/bin/{program}" if self.has_gcloud else None

    def run(self, argv: Sequence[str], *, check: bool = True, capture: bool = False, timeout: float | None = None,
            env: object = None, mutating: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        if self.dry_run and mutating:
            return subprocess.CompletedProcess(argv, 0, "", "")
        code, out, err = self._answer(argv)
        if code and check:
            raise subprocess.CalledProcessError(code, argv, out, err)
        return subprocess.CompletedProcess(argv, code, out, err)

    def _answer(self, argv: list[str]) -> tuple[int, str, str]:
        if argv[1:3] == ["auth", "list"]:
            return 0, f"{self.account}\n" if self.account else "", "" if self.account else "No credentialed accounts."
        if argv[1:3] == ["config", "get-value"]:
            return 0, f"{self.project}\n" if self.project else "", "" if self.project else "(unset)"
        group, verb = argv[3], argv[4]
        if verb in ("accelerator-types", "versions"):
            return 0, "".join(f"{item}\n" for item in (self.offered_types if verb == "accelerator-types"
                                                         else self.offered_versions)), ""
        if group == "tpu-vm" and verb == "describe":
            if self.node is None:
                return 1, "", "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: node"
            return 0, f"{self.node}\t{self.accelerator}\n", ""
        if group == "queued-resources" and verb == "describe":
            if self.queued is None:
                return 1, "", "ERROR: (gcloud.compute.tpus.queued-resources.describe) NOT_FOUND: qr"
            return 0, f"{self.queued}\n", ""
        if verb == "create" and self.create_errors:
            return 1, "", self.create_errors.pop(0)
        if verb == "create":
            if group == "queued-resources":
                self.queued = "ACTIVE"
            self.node = "READY"
            self.accelerator = next(a.split("=", 1)[1] for a in argv if a.startswith("--accelerator-type="))
        elif verb == "delete":
            self.node = None
            if group == "queued-resources":
                self.queued = None
        elif verb == "ssh" and any(a.startswith("--command=") and 'echo "running' in a for a in argv):  # probe
            if self.probe_failures:
                self.probe_failures -= 1
                return 255, "", "ssh: connect to host 10.0.0.2 port 22: Connection timed out"
            return 0, self.worker_job + "\n", ""
        elif verb == "ssh" and any(a.startswith("--command=") and "worker $worker: ended" in a for a in argv):
            return 0, "".join(f"{line}\n" for line in (self.worker_outcomes.pop(0) if self.worker_outcomes else [])), ""
        elif verb == "ssh" and any(a.startswith("--command=") and " -F logs/job.log" in a for a in argv):  # follow
            code, state = self.job_outcomes.pop(0) if self.job_outcomes else (0, None)
            if state is not None:
                self.node = state
                if self.queued is not None and state == "PREEMPTED":
                    self.queued = "SUSPENDED"
            return code, "", ""
        return 0, "", ""
