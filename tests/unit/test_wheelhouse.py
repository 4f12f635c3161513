"""`make wheelhouse` without downloading (deploy/wheelhouse.py): the lock read for the target's markers, the exact
`pip download`, what a folder lacks; and the Slurm doctor's use of one (deploy/slurm/wheels.py): its probe, run here
with bash as a compute node runs it, against a folder of hand-made wheels, with no index."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deploy import wheelhouse
from deploy.slurm import doctor as slurm_doctor
from deploy.slurm import wheels as slurm_wheels
from deploy.slurm.options import SlurmConfig
from job.errors import ConfigError
from tests.doubles import RecordingRunner

ROOT = Path(__file__).resolve().parents[2]
LOCK = (ROOT / "requirements.lock").read_text()
X86 = "manylinux_2_35_x86_64"


def pinned(python: str, platform: str = X86) -> dict[str, str]:
    return dict(pin.split("==") for pin in wheelhouse.pins(LOCK, wheelhouse.WheelTarget(python, platform)))


def test_the_lock_is_read_for_the_targets_python_not_this_one() -> None:
    old, new = pinned("3.11"), pinned("3.12")
    assert (old["jax"], old["jaxlib"], old["flax"]) == ("0.10.2", "0.10.2", "0.12.8")
    assert (new["jax"], new["jaxlib"], new["flax"]) == ("0.12.0.1", "0.12.0.1", "0.12.12")
    assert old.keys() - new.keys() == set() and len(old) == len(new)  # one pin of each name for each Python
    for windows_or_browser in ("colorama", "nest-asyncio", "httpx2-jsfetch"):
        assert windows_or_browser not in old and windows_or_browser not in new
    assert "uvloop" in new and "hf-xet" in pinned("3.12", "manylinux_2_28_aarch64")


@pytest.mark.parametrize(("python", "platform", "says"), [
    ("3.10", X86, "WHEEL_PYTHON (--python): expected a Python version X.Y, 3.11 or newer"),
    ("312", X86, "WHEEL_PYTHON (--python)"),
    ("3.12", "linux_x86_64", "WHEEL_PLATFORM (--platform): expected manylinux_2_M_x86_64 or manylinux_2_M_aarch64"),
    ("3.12", "manylinux_2_35_arm64", "WHEEL_PLATFORM (--platform)"),
])
def test_a_target_no_wheel_can_name_is_one_error(python: str, platform: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"Fix: WHEEL_") as caught:
        wheelhouse.WheelTarget(python, platform)
    assert str(caught.value).startswith(says)


def test_a_platform_takes_every_older_glibc_and_the_old_names() -> None:
    assert wheelhouse.WheelTarget("3.12", "manylinux_2_17_aarch64").platforms() == [
        *(f"manylinux_2_{m}_aarch64" for m in range(17, 4, -1)), "manylinux1_aarch64", "manylinux2010_aarch64",
        "manylinux2014_aarch64"]


def test_the_download_is_the_pins_and_pip_for_the_targets_tags_only(tmp_path: Path) -> None:
    target = wheelhouse.WheelTarget("3.12", "manylinux_2_12_x86_64")
    assert wheelhouse.download_argv(target, tmp_path, "24.2") == [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
        "--implementation", "cp", *(f"--platform=manylinux_2_{m}_x86_64" for m in range(12, 4, -1)),
        "--platform=manylinux1_x86_64", "--platform=manylinux2010_x86_64", "--dest", str(tmp_path), "-r",
        str(tmp_path / "requirements.txt"), "pip==24.2"]


def test_a_dry_run_prints_the_download_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(dry_run=True)
    assert wheelhouse.main(["--dest", str(tmp_path / "w"), "--lock", str(ROOT / "requirements.lock"), "--python",
                            "3.12", "--platform", X86, "--dry-run", "1"], runner) == 0
    assert not (tmp_path / "w").exists()
    assert capsys.readouterr().out.startswith(f"# {tmp_path / 'w' / 'requirements.txt'}: {len(pinned('3.12'))} pins")
    assert runner.calls[0][3:5] == ["download", "--no-deps"]


def hand_made(folder: Path, name: str, version: str = "1.0") -> Path:
    """A pure-Python wheel written by hand (a module and the metadata pip reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": "VALUE = 1\n", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for arc, text in files.items():
            whl.writestr(arc, text)
        whl.writestr(f"{info}/RECORD", "".join(f"{arc},,\n" for arc in files) + f"{info}/RECORD,,\n")
    return path


def made_folder(folder: Path, pins: list[str], lock: Path | None = None) -> Path:
    """A folder as make wheelhouse leaves it, with hand-made wheels for `pins` whose name starts with 'tiny'."""
    for pin in pins:
        name, _, version = pin.partition("==")
        if name.startswith("tiny"):
            hand_made(folder, name, version)
    hand_made(folder, "pip", "24.2")
    (folder / wheelhouse.PINS).write_text("".join(f"{p}\n" for p in pins))
    lock = lock or folder / "x.lock"
    lock.write_text("".join(f"{p}\n" for p in pins))
    (folder / wheelhouse.MANIFEST).write_text(json.dumps({
        "python": "3.12", "platform": X86, "lock": str(lock), "lock_sha256": wheelhouse._sha256(lock),
        "pins": len(pins), "pip": "24.2"}))
    return folder


def test_what_a_folder_lacks_is_listed(tmp_path: Path) -> None:
    folder = made_folder(tmp_path / "w", ["tinyone==1.0", "absent==2.0"])
    assert wheelhouse.problems(folder) == ["no wheel for absent==2.0"]
    (folder / "x.lock").write_text("tinyone==1.1\n")
    assert wheelhouse.problems(folder, tmp_path)[-1] == f"{folder / 'x.lock'} changed since the wheelhouse was made from it"
    (folder / wheelhouse.MANIFEST).unlink()
    assert wheelhouse.problems(folder) == [f"{folder}: No such file or directory"]
    with pytest.raises(ConfigError, match=r"WHEELHOUSE: expected a folder made by make wheelhouse .*Fix: make wheelhouse"):
        wheelhouse.manifest(folder)


# ---------------------------------------------------------------------------------------------------- Slurm
def probe(folder: Path, python: str = sys.executable) -> dict[str, str]:
    """slurm/doctor-probe.sh with the wheelhouse part, run here as srun runs it on a compute node, with pip's network
    refused (a proxy on a closed port): its findings."""
    cfg = SlurmConfig(nodes=1, python=python)
    argv = slurm_doctor.probe_argv(cfg, None, "token", "", 30, str(folder))
    script = argv[argv.index("bash"):]
    closed = "http://127.0.0.1:9"
    proc = subprocess.run(script, capture_output=True, text=True, timeout=120, cwd=ROOT, env={
        "PATH": "/usr/bin:/bin", "HOME": str(folder.parent), "SLURMD_NODENAME": "node1", "https_proxy": closed,
        "http_proxy": closed, "PIP_INDEX_URL": f"{closed}/simple", "PIP_FIND_LINKS": "", "JAX_PLATFORMS": "cpu"})
    return slurm_doctor.findings(proc.stdout)


@pytest.mark.slow
def test_the_probe_installs_every_pin_from_the_wheelhouse_with_no_index_or_names_what_fails(tmp_path: Path) -> None:
    good = made_folder(tmp_path / "good", ["tinyone==1.0", "tinytwo==2.0"])
    found = probe(good)
    assert found["wheelhouse"] == "ok" and found["python"].startswith("ok "), found
    check = slurm_wheels.on_node(SlurmConfig(nodes=1, python=sys.executable), str(good), found, "node1")
    assert check.line() == (f"ok    wheelhouse on a compute node: {sys.executable} on node1 installs every pin of {good} "
                            "with no index (pip --dry-run)")
    bad = made_folder(tmp_path / "bad", ["tinyone==1.0", "absl-py==2.5.1"])  # no wheel of absl-py: an index needed
    found = probe(bad)
    assert found["wheelhouse"].startswith("failed 1 "), found
    line = slurm_wheels.on_node(SlurmConfig(nodes=1, python=sys.executable), str(bad), found, "node1").line()
    assert line.startswith(f"FAIL  wheelhouse on a compute node: {sys.executable} on node1 cannot install from "
                           f"WHEELHOUSE={bad} with no index (pip exit 1: "), line
    version = "{}.{}".format(*sys.version_info[:2])
    assert f"Fix: make wheelhouse WHEELHOUSE={bad} WHEEL_PYTHON={version} WHEEL_PLATFORM=manylinux_2_M_" in line
    assert probe(tmp_path / "nowhere")["wheelhouse"] == "missing"


def test_the_doctor_checks_the_folder_here_and_probes_it_only_when_given(tmp_path: Path) -> None:
    folder = made_folder(tmp_path / "w", ["tinyone==1.0"], lock=tmp_path / "x.lock")
    assert slurm_wheels.here(str(folder)).line() == (
        f"ok    wheelhouse: {folder}: Python 3.12 on {X86}, 1 pin of {tmp_path / 'x.lock'}, a wheel for every pin")
    (folder / "tinyone-1.0-py3-none-any.whl").unlink()
    assert slurm_wheels.here(str(folder)).line().startswith(f"FAIL  wheelhouse: WHEELHOUSE={folder}: no wheel for "
                                                            "tinyone==1.0. Fix: make wheelhouse")
    options, rest = slurm_doctor.parse_options(["--nodes", "2", f"--wheelhouse={folder}", "--", "train"])
    assert options.wheelhouse == str(folder) and rest == ["--nodes", "2", "--", "train"]
    cfg = SlurmConfig(nodes=1)
    assert slurm_doctor.probe_argv(cfg, None, "t", "", 30)[-1] == ""  # RUNTIME: no wheelhouse argument, no part
    argv = slurm_doctor.probe_argv(cfg, None, "t", "", 30, str(folder))
    assert argv[-1] == str(folder) and argv[argv.index("-c") + 1].endswith(slurm_wheels.PROBE)
