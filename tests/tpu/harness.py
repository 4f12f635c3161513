"""Run `make tpu-*` and `python -m deploy.tpu` against the gcloud simulator, with readable failures."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.tpu import fake_gcloud
from tests.tpu.fake_gcloud import state as fake_state

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ZONE = "us-central2-b"
# Make variables of the TPU targets: never inherited from the caller's environment.
MAKE_VARS = ("TPU_NAME", "ZONE", "ACCELERATOR", "RUNTIME", "PROJECT", "SPOT", "QUEUED", "IMAGE", "ARGS",
             "RETRIES", "DRY_RUN", "TPU_LOCAL_DIR", "BUCKET", "RESERVED", "INTERNAL_IP", "NETWORK", "SUBNETWORK",
             "SERVICE_ACCOUNT", "TAGS", "SLICES", "CREATE_DEADLINE", "SWEEP", "SHIP", "WHEELHOUSE", "WHEEL_PYTHON",
             "WHEEL_PLATFORM", "WHEEL_LOCK")
# A tiny model and short runs: what matters here is the path through gcloud, not the training.
SMALL = "--model.layers 1 --model.dim 32 --model.mlp-dim 64 --data.eval-batches 1"


def makefile_flags() -> list[str]:
    """The project's Makefile, whose tpu-* targets are under test."""
    return ["-f", str(ROOT / "Makefile")]


@dataclasses.dataclass
class Cloud:
    """One simulated cloud (a state folder) and a local folder for logs, per test."""

    state: Path
    local: Path

    def env(self, *, with_gcloud: bool = True, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()  # gcloud's own CLOUDSDK_* variables would override the simulated
               if k not in MAKE_VARS and k not in ("XLA_FLAGS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")  # config
               and not k.startswith("CLOUDSDK_")}
        path = env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
        if with_gcloud:
            path.insert(0, str(fake_gcloud.BIN_DIR))
        else:  # no gcloud anywhere on PATH: only make, from a folder of its own
            bare = self.local.parent / "bin-without-gcloud"
            bare.mkdir(parents=True, exist_ok=True)
            if not (bare / "make").exists():
                (bare / "make").symlink_to(shutil.which("make") or "/usr/bin/make")
            path = [str(bare)]
        env.update(PATH=os.pathsep.join(path), FAKE_GCLOUD_STATE=str(self.state), FAKE_GCLOUD_PYTHON=sys.executable,
                   PYTHONUNBUFFERED="1", **extra)
        return env

    def make_argv(self, target: str, **variables: str) -> list[str]:
        variables.setdefault("TPU_LOCAL_DIR", str(self.local))
        assert shutil.which("make"), "make is needed to run the TPU targets"
        return ["make", "--no-print-directory", *makefile_flags(), "-o", f"{BIN}/.installed", f"BIN={BIN}",
                target, *(f"{k}={v}" for k, v in variables.items())]

    def make(self, target: str, *, timeout: float = 240, env: dict[str, str] | None = None,
             **variables: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.make_argv(target, **variables), cwd=ROOT, env=env or self.env(),
                              capture_output=True, text=True, timeout=timeout)

    def cli(self, *argv: str, timeout: float = 120, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deploy.tpu", *argv], cwd=ROOT, env=env or self.env(),
                              capture_output=True, text=True, timeout=timeout)

    def gcloud(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(fake_gcloud.BIN_DIR / "gcloud"), *argv], cwd=ROOT, env=self.env(),
                              capture_output=True, text=True, timeout=timeout)

    def calls(self) -> list[list[str]]:
        return fake_gcloud.calls(self.state)

    def tpu_calls(self) -> list[list[str]]:
        """The `gcloud compute tpus ...` calls: without the doctor's questions to `auth` and `config`."""
        return [c for c in self.calls() if c[:2] == ["compute", "tpus"]]

    def home(self, name: str, worker: int) -> Path:
        """The home folder of worker `worker` of slice `name` (in ZONE, the default project): what it was sent."""
        return fake_state.Cloud(self.state).home(fake_state.DEFAULT_PROJECT, ZONE, name, worker)

    def verbs(self) -> list[str]:
        """Each call as "tpu-vm create", "tpu-vm ssh", ..."""
        return [" ".join(c[2:4]) for c in self.calls()]
