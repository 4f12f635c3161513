"""Stand-ins for the subprocess boundary: a `deploy.runner.Runner` that records argv instead of running it."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Sequence

from deploy.runner import Runner


@dataclasses.dataclass
class RecordingRunner(Runner):
    """Records every argv; answers from `responses` (first matching argv prefix) or with success."""

    calls: list[list[str]] = dataclasses.field(default_factory=list)
    responses: dict[tuple[str, ...], tuple[int, str]] = dataclasses.field(default_factory=dict)
    available: tuple[str, ...] = ()  # programs `which` finds

    def which(self, program: str) -> str | None:
        return f"/usr/bin/{program}" if program in self.available else None

    def run(self, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:  # type: ignore[override]
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        for prefix, (code, out) in self.responses.items():
            if tuple(argv[: len(prefix)]) == prefix:
                if code and kwargs.get("check", True):
                    raise subprocess.CalledProcessError(code, argv, out, "")
                return subprocess.CompletedProcess(argv, code, out, "")
        return subprocess.CompletedProcess(argv, 0, "", "")
