"""WHEELHOUSE on a TPU slice: the workers install the job's dependencies from `make wheelhouse`'s folder, without a
package index (air-gapped VMs).

    make wheelhouse FLAVOR=tpu WHEEL_PYTHON=3.11 WHEEL_PLATFORM=manylinux_2_35_x86_64
    make tpu-pod WHEELHOUSE=wheelhouse TPU_NAME=... ZONE=... ARGS=...

`require` checks the folder before any gcloud call: whole (deploy/wheelhouse.py's `problems`), made for x86_64 (the
TPU VMs' hosts) and holding libtpu (FLAVOR=tpu's lock), without which JAX on the VM would train on its CPU. The folder
travels to every worker as one uncompressed tar (wheels are compressed already) beside the code, is unpacked into
REMOTE_DIR/.wheelhouse, and the set-up (deploy/tpu/remote.py's WHEELHOUSE_SETUP) installs from it with
`pip --isolated --no-index` into REMOTE_DIR/.venv, made by the VM's python3 `--without-pip` (pip comes from the
folder, so the VM needs no python3-venv). The VM's python3 must be the wheelhouse's Python: the set-up says so.
"""

from __future__ import annotations

import logging
import tarfile
from pathlib import Path

from deploy import wheelhouse
from deploy.runner import Runner
from deploy.tpu import gcloud
from deploy.tpu.config import TpuConfig
from job.core.errors import ConfigError

log = logging.getLogger("deploy.tpu")

ARCHIVE = "wheels.tar"  # in LOCAL_DIR/NAME, beside the code's archive
REMOTE = ".wheelhouse"  # in REMOTE_DIR on every worker
MACHINE = "x86_64"  # what TPU VM hosts are
NEEDED = "libtpu"  # JAX finds the TPU through it
FIX = "make wheelhouse FLAVOR=tpu WHEEL_PYTHON=X.Y (the VMs' python3) WHEEL_PLATFORM=manylinux_2_35_x86_64"


def remote_archive(cfg: TpuConfig) -> str:
    """Where the tar lands on each worker (its home), unpacked from REMOTE_DIR as ../THIS."""
    return f"{cfg.remote_dir}-{ARCHIVE}"


def require(cfg: TpuConfig) -> None:
    """WHEELHOUSE (when given): a whole wheelhouse for TPU VMs; one ConfigError naming what is wrong otherwise."""
    if cfg.wheelhouse is None:
        return
    if cfg.image:
        raise ConfigError("WHEELHOUSE (--wheelhouse)", expected="WHEELHOUSE or IMAGE: the image holds the dependencies",
                          found=f"WHEELHOUSE={cfg.wheelhouse} IMAGE={cfg.image}", fix="leave WHEELHOUSE empty with IMAGE")
    folder = Path(cfg.wheelhouse)
    found = wheelhouse.problems(folder, Path(cfg.source_dir))
    if found:
        raise ConfigError("WHEELHOUSE (--wheelhouse)", expected="a folder made by make wheelhouse, every pin's wheel in it",
                          found=f"{folder}: {'; '.join(found)}", fix=FIX)
    made = wheelhouse.manifest(folder)
    platform = str(made.get("platform"))
    pinned = {name for name, _ in wheelhouse.pinned(folder)}
    if not platform.endswith(f"_{MACHINE}") or NEEDED not in pinned:
        raise ConfigError("WHEELHOUSE (--wheelhouse)", expected=f"wheels for TPU VMs: {MACHINE}, with {NEEDED} (JAX on "
                          "the VM would train on its CPU without it)",
                          found=f"{folder}: {wheelhouse.describe(folder)}"
                          + ("" if NEEDED in pinned else f", no {NEEDED}"),
                          fix=FIX)


def build_archive(cfg: TpuConfig) -> Path:
    """LOCAL_DIR/NAME/wheels.tar: the wheelhouse's files, flat (nothing in a dry run)."""
    path = cfg.slice_dir / ARCHIVE
    if cfg.dry_run or cfg.wheelhouse is None:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for item in sorted(Path(cfg.wheelhouse).iterdir()):
            if item.is_file():
                tar.add(item, arcname=item.name)
    return path


def upload(cfg: TpuConfig, runner: Runner, name: str, archive: Path) -> None:
    """The wheelhouse's tar to every worker of slice `name`."""
    runner.run(gcloud.upload(cfg, str(archive), remote_archive(cfg), name))


def describe(cfg: TpuConfig) -> str:
    """The doctor's `wheelhouse` line; ConfigError when `require` fails."""
    require(cfg)
    folder = Path(cfg.wheelhouse or "")
    size = sum(p.stat().st_size for p in folder.glob("*.whl")) / 2**20
    return (f"{folder}: {wheelhouse.describe(folder)}, {size:.0f} MiB; every worker installs from it with no index "
            "(its python3 must be that version)")
