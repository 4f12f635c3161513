"""`make wheelhouse`: the locked wheels for a target Python and platform in one folder, for machines that reach no
package index (air-gapped TPU VMs and Slurm compute nodes).

    make wheelhouse [WHEELHOUSE=wheelhouse] [WHEEL_PYTHON=3.12] [WHEEL_PLATFORM=manylinux_2_35_x86_64] [FLAVOR=tpu]
    python -m deploy.wheelhouse --dest wheelhouse --lock docker/requirements-tpu.lock --python 3.12 \\
        --platform manylinux_2_35_x86_64
    python -m deploy.wheelhouse --check wheelhouse      # what is missing, one line each; exit 1 if anything

The lock's markers are read for the target, not for this machine (python_full_version, sys_platform,
platform_machine, ...), and `pip download --no-deps --only-binary=:all:` fetches exactly the pins that remain, for
the target's tags: CPython X.Y (its ABI, abi3, none) on every manylinux up to the platform's glibc, for its machine.
The folder then holds

    requirements.txt   the target's pins, one `name==version` a line: what an install asks for
    *.whl              one wheel per pin, and pip's own (a venv made `--without-pip` gets pip from it)
    wheelhouse.json    the target: Python, platform, the lock and its sha256; written last (a folder without it is
                       unfinished)

and a machine of that Python and platform installs with no index (--isolated: no pip config adds another source):

    python -m pip install --isolated --no-index --find-links W -r W/requirements.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import sys_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from deploy.runner import Runner
from job.core import values
from job.core.errors import ConfigError, require

log = logging.getLogger("deploy.wheelhouse")

MANIFEST = "wheelhouse.json"
PINS = "requirements.txt"
MIN_PYTHON = (3, 11)  # pyproject's requires-python
OLDEST_GLIBC = 5  # manylinux_2_5 (manylinux1): the oldest tag a wheel carries
_PYTHON = re.compile(r"^3\.([0-9]{1,2})$")
_PLATFORM = re.compile(r"^manylinux_2_([0-9]{1,2})_(x86_64|aarch64)$")
_LEGACY = {5: "manylinux1", 12: "manylinux2010", 17: "manylinux2014"}  # the older names of manylinux_2_{5,12,17}
INSTALL = "python -m pip install --isolated --no-index --find-links {w} -r {w}/" + PINS


@dataclasses.dataclass(frozen=True)
class WheelTarget:
    """The machines a wheelhouse is for: the Python that installs from it and their platform."""

    python: str  # 'X.Y': the interpreter that installs from the folder
    platform: str  # manylinux_2_M_ARCH: the newest glibc (2.M) the machine has, and its machine

    def __post_init__(self) -> None:
        version = _PYTHON.fullmatch(self.python)
        require(version is not None and (3, int(version.group(1))) >= MIN_PYTHON, "WHEEL_PYTHON (--python)",
                "a Python version X.Y, 3.11 or newer (the lock's requires-python)", self.python,
                "WHEEL_PYTHON=3.12: the python3 of the machines that install (`python3 --version` there)")
        require(_PLATFORM.fullmatch(self.platform) is not None, "WHEEL_PLATFORM (--platform)",
                "manylinux_2_M_x86_64 or manylinux_2_M_aarch64, M the machines' glibc (ldd --version: 2.35 -> 35)",
                self.platform, "WHEEL_PLATFORM=manylinux_2_35_x86_64 (Ubuntu 22.04, the TPU VM images; RHEL 8: 2_28)")

    @property
    def glibc(self) -> int:
        return int(self._parts.group(1))

    @property
    def machine(self) -> str:
        return self._parts.group(2)

    @property
    def _parts(self) -> re.Match[str]:
        found = _PLATFORM.fullmatch(self.platform)
        assert found is not None  # checked in __post_init__
        return found

    def platforms(self) -> list[str]:
        """Every platform tag a wheel may carry to run there: manylinux_2_5 .. manylinux_2_M (and the old names)."""
        glibc, machine = self.glibc, self.machine
        tags = [f"manylinux_2_{m}_{machine}" for m in range(glibc, OLDEST_GLIBC - 1, -1)]
        return tags + [f"{name}_{machine}" for m, name in _LEGACY.items() if m <= glibc]

    def environment(self) -> dict[str, str]:
        """The values environment markers read, as the target's CPython on Linux has them."""
        return {"python_version": self.python, "python_full_version": f"{self.python}.0", "os_name": "posix",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": self.machine,
                "implementation_name": "cpython", "platform_python_implementation": "CPython",
                "implementation_version": f"{self.python}.0", "platform_release": "", "platform_version": "",
                "extra": ""}


def this_platform() -> str:
    """This machine's newest manylinux tag (manylinux_2_36_x86_64 on Debian 12); manylinux_2_28_x86_64 elsewhere."""
    return next((str(tag.platform) for tag in sys_tags() if _PLATFORM.fullmatch(str(tag.platform))),
                "manylinux_2_28_x86_64")


def pins(lock: str, target: WheelTarget) -> list[str]:
    """`name==version` of every line of a lock (uv pip compile's output) whose marker holds on the target."""
    found = []
    for number, line in enumerate(lock.splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text or text.startswith("-"):
            continue
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            raise ConfigError("the lock", expected="one pinned requirement a line (name==version ; marker)",
                              found=f"line {number}: {line!r} ({exc})", fix="make lock") from exc
        if req.marker is None or req.marker.evaluate(target.environment()):
            found.append(f"{req.name}=={next(iter(req.specifier)).version}")
    return found


def download_argv(target: WheelTarget, dest: Path, pip_version: str) -> list[str]:
    """pip download of the pins in dest/requirements.txt and of pip itself, for the target's tags only."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
            target.python, "--implementation", "cp", *(f"--platform={tag}" for tag in target.platforms()),
            "--dest", str(dest), "-r", str(dest / PINS), f"pip=={pip_version}"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wheel(path: Path) -> tuple[str, str] | None:
    """(canonical name, version) of a wheel file, or None for any other file."""
    try:
        name, version, _, _ = parse_wheel_filename(path.name)
    except InvalidWheelFilename:
        return None
    return str(name), str(version)


def pinned(folder: Path) -> set[tuple[str, str]]:
    """(canonical name, version) of every pin in the folder's requirements.txt."""
    lines = (folder / PINS).read_text().split()
    return {(str(canonicalize_name(name)), version) for name, _, version in (p.partition("==") for p in lines)}


def build(dest: Path, lock: Path, target: WheelTarget, runner: Runner) -> int:
    """Fill `dest` for `target` from `lock`; 0 when complete, else pip's exit code (its words are above)."""
    require(lock.is_file(), "WHEEL_LOCK (--lock)", "a lock file such as requirements.lock", str(lock),
            "run from the checkout's root, or WHEEL_LOCK=docker/requirements-tpu.lock")
    wanted = pins(lock.read_text(), target)
    if runner.dry_run:
        print(f"# {dest / PINS}: {len(wanted)} pins of {lock} for Python {target.python} on {target.platform}")
    else:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / MANIFEST).unlink(missing_ok=True)  # unfinished until it is written again
        (dest / PINS).write_text("".join(f"{p}\n" for p in wanted))
    pip_version = importlib.metadata.version("pip")
    code = runner.run(download_argv(target, dest, pip_version), check=False).returncode
    if code != 0:
        log.error("pip download failed (exit %d; its words are above): every pin needs a wheel for Python %s on %s. "
                  "Fix: another WHEEL_PLATFORM (a newer glibc, e.g. manylinux_2_35_x86_64) or WHEEL_PYTHON; a pin "
                  "that has no wheel at all needs `pip wheel` on a machine of the target's kind", code, target.python,
                  target.platform)
        return code
    if runner.dry_run:
        return 0
    keep = pinned(dest) | {("pip", pip_version)}
    for stale in dest.glob("*.whl"):  # an earlier target's wheels
        if _wheel(stale) not in keep:
            stale.unlink()
    manifest = {"python": target.python, "platform": target.platform, "lock": str(lock), "lock_sha256": _sha256(lock),
                "pins": len(wanted), "pip": pip_version}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"{len(keep)} wheels, {size / 2**20:.0f} MiB, for Python {target.python} on {target.platform} in {dest} "
          f"(from {lock}); install there with: {INSTALL.format(w=dest)}", flush=True)
    return 0


def manifest(folder: Path) -> dict[str, object]:
    """wheelhouse.json of `folder`; ConfigError when it has none (not made by make wheelhouse, or unfinished)."""
    try:
        found = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("WHEELHOUSE", expected=f"a folder made by make wheelhouse (with {MANIFEST})",
                          found=f"{folder}: {exc.strerror if isinstance(exc, OSError) else exc}",
                          fix=f"make wheelhouse WHEELHOUSE={folder} (a folder without {MANIFEST} is unfinished)") from exc
    require(isinstance(found, dict), "WHEELHOUSE", f"{MANIFEST} holding an object", found, "make wheelhouse again")
    return found


def problems(folder: Path, root: Path | None = None) -> list[str]:
    """What keeps `folder` from installing its pins with no index: no manifest, pins without a wheel, no pip wheel,
    and (with `root`, the checkout) a lock that changed since the folder was made. Empty when it is whole."""
    try:
        made = manifest(folder)
        pins_there = pinned(folder)
    except ConfigError as exc:
        return [f"{exc.found}"]
    except OSError as exc:
        return [f"{folder / PINS}: {exc.strerror}"]
    have = {w for w in map(_wheel, folder.glob("*.whl")) if w is not None}
    found = [f"no wheel for {name}=={version}" for name, version in sorted(pins_there - have)]
    if not any(name == "pip" for name, _ in have):
        found.append("no wheel of pip (a venv made --without-pip takes pip from it)")
    lock = root / str(made.get("lock")) if root is not None else None
    if lock is not None and lock.is_file() and _sha256(lock) != made.get("lock_sha256"):
        found.append(f"{made.get('lock')} changed since the wheelhouse was made from it")
    return found


def describe(folder: Path) -> str:
    """'Python 3.12 on manylinux_2_35_x86_64, 71 pins of docker/requirements-tpu.lock': what the folder is for."""
    made = manifest(folder)
    pins = made.get("pins")
    return f"Python {made.get('python')} on {made.get('platform')}, {pins} pin{'' if pins == 1 else 's'} of {made.get('lock')}"


def main(argv: Sequence[str] | None = None, runner: Runner | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[wheelhouse] %(message)s")
    parser = argparse.ArgumentParser(prog="python -m deploy.wheelhouse", description=__doc__.split("\n")[0])
    parser.add_argument("--dest", default="wheelhouse", help="WHEELHOUSE: the folder to fill (default: wheelhouse)")
    parser.add_argument("--lock", default="requirements.lock", help="WHEEL_LOCK: the lock whose pins to fetch")
    parser.add_argument("--python", default="", help="WHEEL_PYTHON: X.Y of the target (default: this interpreter's)")
    parser.add_argument("--platform", default="", help="WHEEL_PLATFORM: manylinux_2_M_ARCH (default: this machine's)")
    parser.add_argument("--dry-run", type=values.for_argparse(values.switch), default=False,
                        help="DRY_RUN=1: print the pip command instead of running it")
    parser.add_argument("--check", default="", help="a wheelhouse to check instead: one line per problem")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.check:
            found = problems(Path(args.check), Path.cwd())
            for line in found or [f"ok: {args.check}: {describe(Path(args.check))}, every pin has its wheel"]:
                print(line, flush=True)
            return 1 if found else 0
        target = WheelTarget(args.python or "{}.{}".format(*sys.version_info[:2]), args.platform or this_platform())
        return build(Path(args.dest), Path(args.lock), target, runner or Runner(dry_run=args.dry_run))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
