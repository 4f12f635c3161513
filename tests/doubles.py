"""Stand-ins for the subprocess boundary: a `deploy.runner.Runner` that records argv instead of running it."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Sequence

from deploy.runner import Runner

# What a roomy Slurm login node answers to the partition queries every submission makes first
# (deploy/slurm/partitions.py): one default partition `debug`, UP, no time limit, 64 nodes of 128 CPUs,
# 8 GPUs and 1 TiB each. A test that wants another cluster answers those argv prefixes in `responses`.
PARTITION = ("PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL Default=YES DefaultTime=NONE "
             "Hidden=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 Nodes=node[1-64] State=UP TotalNodes=64\n")
NODES = "".join(f"node{i}|idle|128|1048576|gpu:8\n" for i in range(1, 65))
LOGIN_NODE: dict[tuple[str, ...], tuple[int, str]] = {
    ("scontrol", "--all", "--oneliner", "show", "partition"): (0, PARTITION),
    ("sinfo", "--noheader", "--Node"): (0, NODES),
}


@dataclasses.dataclass
class RecordingRunner(Runner):
    """Records every argv; answers from `responses` (first matching argv prefix), then as LOGIN_NODE does for
    the partition queries, or with success."""

    calls: list[list[str]] = dataclasses.field(default_factory=list)
    responses: dict[tuple[str, ...], tuple[int, str]] = dataclasses.field(default_factory=dict)
    available: tuple[str, ...] = ()  # programs `which` finds

    def which(self, program: str) -> str | None:
        return f"/usr/bin/{program}" if program in self.available else None

    def run(self, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:  # type: ignore[override]
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        for prefix, (code, out) in [*self.responses.items(), *LOGIN_NODE.items()]:
            if tuple(argv[: len(prefix)]) == prefix:
                if code and kwargs.get("check", True):
                    raise subprocess.CalledProcessError(code, argv, out, "")
                return subprocess.CompletedProcess(argv, code, out, "")
        return subprocess.CompletedProcess(argv, 0, "", "")

    def run_echoing_stderr(self, argv: Sequence[str], *, env: object = None  # type: ignore[override]
                           ) -> subprocess.CompletedProcess[str]:
        """As `run`, the answer's text as the command's stderr (a step's srun messages)."""
        done = self.run(argv, check=False)
        return subprocess.CompletedProcess(done.args, done.returncode, "", done.stdout)
