"""Security basics, each checked against what the code really does.

1. No shell with user data: no `shell=True`, `os.system`, `os.popen`, ... in any
   Python file (the shell scripts themselves: shellcheck, in
   tests/container/test_static.py).
2. Generated commands quote every user word: the TPU workers' bash, the
   Slurm batch script and the Makefile's tpu-* targets, fed hostile words by
   hypothesis, hand exactly those words on and run none of them.
3. The image runs as a fixed non-root user (statically here; `id -u` in the
   built image: tests/container/test_image.py).
4. Nothing secret reaches the image's build context, the TPU code archive, a
   training run's output or run folder, a Slurm submission, or a gcloud argv.

Fixed hostile lists that other tests already run end to end, not repeated
here: tests/tpu/test_remote.py (the whole worker script), tests/tpu/test_pod.py
(`make tpu-pod` through the gcloud simulator), tests/unit/test_deploy_slurm.py
(the sbatch argv keeps user words separate).
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import importlib.util
import logging
import os
import posixpath
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from deploy.slurm import submit as slurm
from deploy.tpu import cli as tpu
from deploy.tpu import gcloud as tpu_gcloud
from deploy.tpu import job as tpu_job
from deploy.tpu import remote as tpu_remote
from deploy.tpu.accelerators import parse_accelerator
from deploy.tpu.config import TpuConfig, run_dir_of
from tests.doubles import RecordingRunner

ROOT = Path(__file__).resolve().parents[2]
# Each example starts a shell; no example database is written into the checkout.
FEW = settings(max_examples=40, deadline=None, database=None)

# ---------------------------------------------------------------------------------------------------
# 1. No shell with user data
# ---------------------------------------------------------------------------------------------------
SCANNED = ("job", "deploy", "bench", "docker", "slurm", "tests")
SHELL_FUNCTIONS = frozenset({
    "os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput",
    "asyncio.create_subprocess_shell", "commands.getoutput", "commands.getstatusoutput",
})
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})


def python_files() -> list[Path]:
    """Every Python file under SCANNED (by suffix or by a python shebang), outside virtualenvs."""
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or {".venv", "__pycache__"} & set(path.parts):
                continue
            if path.suffix == ".py":
                found.append(path)
            elif not path.suffix:
                with path.open("rb") as f:
                    first = f.readline()
                if first.startswith(b"#!") and b"python" in first:
                    found.append(path)
    return found


class _ShellCalls(ast.NodeVisitor):
    """Calls that hand a string to a shell; `production` also flags `[sh, -c, <built string>]`."""

    def __init__(self, tree: ast.AST, production: bool) -> None:
        self.production = production
        self.found: list[tuple[int, str]] = []
        self.aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        self.visit(tree)

    def dotted(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        if name in SHELL_FUNCTIONS:
            self.found.append((node.lineno, f"{name}() runs its argument through a shell"))
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "subprocess_shell":
            self.found.append((node.lineno, ".subprocess_shell() runs its argument through a shell"))
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and not kw.value.value):
                self.found.append((node.lineno, f"shell={ast.unparse(kw.value)}"))
        self.generic_visit(node)

    def _argv(self, node: ast.List | ast.Tuple) -> None:
        items = node.elts
        if (self.production and items and isinstance(items[0], ast.Constant) and isinstance(items[0].value, str)
                and posixpath.basename(items[0].value) in SHELLS):
            for i, item in enumerate(items[1:-1], start=1):
                script = items[i + 1]
                if (isinstance(item, ast.Constant) and item.value == "-c"
                        and not (isinstance(script, ast.Constant) and isinstance(script.value, str))):
                    self.found.append((node.lineno, f"{items[0].value} -c runs a built string"))
        self.generic_visit(node)

    visit_List = _argv
    visit_Tuple = _argv


def shell_calls(source: str, production: bool = True) -> list[tuple[int, str]]:
    return _ShellCalls(ast.parse(source), production).found


@pytest.mark.parametrize("snippet", [
    "import subprocess\nsubprocess.run(cmd, shell=True)",
    "import subprocess as sp\nsp.Popen(cmd, shell=1)",
    "from subprocess import check_output\ncheck_output(cmd, shell=use_shell)",
    "import os\nos.system('ls ' + name)",
    "from os import system as run\nrun(cmd)",
    "import os\nos.popen(cmd).read()",
    "import subprocess\nsubprocess.getoutput(cmd)",
    "from subprocess import getstatusoutput\ngetstatusoutput(cmd)",
    "import asyncio\nasyncio.create_subprocess_shell(cmd)",
    "loop.subprocess_shell(factory, cmd)",
    "import subprocess\nsubprocess.run(['bash', '-c', f'echo {name}'])",
    "import subprocess\nsubprocess.run(('/bin/sh', '-e', '-c', script))",
])
def test_the_scanner_flags_every_way_to_hand_a_string_to_a_shell(snippet: str) -> None:
    assert shell_calls(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "import subprocess\nsubprocess.run(['ls', name], shell=False)",
    "import subprocess\nsubprocess.run(['bash', '-c', 'echo constant'])",
    "import subprocess\nsubprocess.run(['sh', path])",
    "import os\nos.path.join(a, b)",
    "shell = True",
    "mymodule.system(cmd)",
])
def test_the_scanner_leaves_argv_lists_and_lookalikes_alone(snippet: str) -> None:
    assert shell_calls(snippet) == []


def test_no_python_file_hands_a_string_to_a_shell() -> None:
    files = python_files()
    scanned = {p.relative_to(ROOT).as_posix() for p in files}
    # Not vacuous: the files that run programs are among those scanned.
    assert {"deploy/runner.py", "job/launch.py", "docker/run_local.py", "tests/tpu/fake_gcloud/ssh.py"} <= scanned
    found = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        # Tests run the TPU workers' scripts with `bash -c` on purpose (that is what ssh does).
        for line, what in shell_calls(path.read_text(), production=not rel.startswith("tests/")):
            found.append(f"{rel}:{line}: {what}")
    assert not found, "expected argv lists (deploy.runner.Runner), found a shell:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------------
# 2. Generated commands quote every user word
# ---------------------------------------------------------------------------------------------------
PWNED = "pwned"  # what a hostile word tries to create in the working folder
FRAGMENTS = (
    "'", '"', "\\", f"$(touch {PWNED})", f"`touch {PWNED}`", f"; touch {PWNED}", f"&& touch {PWNED} #",
    f"| touch {PWNED}", f"\ntouch {PWNED}\n", "$HOME", "${IFS}", "$'\\x41'", "*", "?", "[a]", "~", "#", "!",
    "-", "--", "-rf", "--x=1", " ", "\t", "\r", "é", "日本", "🙂", "\u200b", "=", ",", "%s", "%j", "\x1b[31m",
)
WORD = st.lists(st.one_of(st.sampled_from(FRAGMENTS),
                          st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)),
                                  max_size=6)), max_size=5).map("".join)
ARGV = st.lists(WORD, max_size=6)
IMAGE = "us-docker.pkg.dev/my-proj/repo/job:1"
# Stand-ins on the workers: `"$py"` and `docker` print their argv, NUL-separated, and run nothing.
RECORD = "rec() { printf '%s\\0' \"$@\"; }; docker() { rec \"$@\"; }; py=rec; sudo=\n"


def shell(argv: Sequence[str], cwd: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "LC_ALL": "C", **(env or {})}
    return subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, timeout=60, check=False)


def nul_split(data: bytes) -> list[str]:
    return [part.decode() for part in data.split(b"\0")[:-1]]


@FEW
# (argparse drops an option value that is exactly "--", so ARGS='--' alone cannot travel: nothing to run anyway)
@given(words=ARGV.filter(lambda words: words != ["--"]), image=st.booleans())
def test_tpu_job_arguments_reach_every_worker_verbatim_and_none_runs_as_shell(words: list[str], image: bool) -> None:
    # `make tpu-pod ARGS=...` hands deploy.tpu.cli one shell-style string; the workers' bash must see the words.
    flags = ["run", "--name=pod-1", "--zone=us-central2-b", f"--args={shlex.join(words)}"]
    _, cfg = tpu.parse_args([*flags, *([f"--image={IMAGE}"] if image else [])])
    assert cfg.job_args == tuple(words)
    script = tpu_remote.start_script(cfg)
    assert tpu_gcloud.ssh_all(cfg, script)[-1] == f"--command={script}"  # one argv item: no local shell reads it
    command = tpu_remote.job_command(cfg)
    # the job runs detached: `setsid nohup bash -c WRAPPER`, and the wrapper runs the command
    assert script.count("setsid nohup bash -c ") == 1, script
    wrapper = shlex.split(script[script.index("setsid nohup bash -c "):])[4]
    assert command in wrapper  # the job's arguments reach the workers through this command only
    with tempfile.TemporaryDirectory() as tmp:
        here = os.path.realpath(tmp)
        proc = shell(["bash", "-c", RECORD + command], here)
        assert proc.returncode == 0, proc.stderr
        assert os.listdir(here) == [], "a word ran as shell"
    run_dir = (run_dir_of(cfg.job_args) or "").rstrip("/")
    # an absolute run dir two folders deep or more: its parent is mounted at the same path
    parent = run_dir.rsplit("/", 1)[0] if run_dir.startswith("/") and run_dir.count("/") >= 2 else ""
    workspace = f"{here}/{tpu_remote.WORKSPACE}"
    docker = ["run", "--rm", f"--name={cfg.remote_dir}", "--init", f"--stop-timeout={int(cfg.stop_grace_s)}",
              "--privileged", "--network=host", f"--user={os.getuid()}:{os.getgid()}",
              f"--volume={workspace}:{workspace}", *([f"--volume={parent}:{parent}"] if parent else []),
              f"--workdir={workspace}", f"--env=HOME={workspace}", "--env=PYTHONUNBUFFERED=1",
              *(f"--env={name}" for name in tpu_remote.WORKER_VARS), IMAGE, "python"]
    assert nul_split(proc.stdout) == [*(docker if image else []), "-m", "job", *words]


def test_remote_scripts_do_not_forward_this_machines_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_tpu_SECRET_4e1d")
    for image in (None, IMAGE):
        cfg = TpuConfig(name="pod-1", zone="us-central2-b", image=image, job_args=("train",))
        scripts = [tpu_remote.setup_script(cfg), tpu_remote.start_script(cfg), tpu_remote.stop_script(cfg)]
        for text in scripts:
            assert "hf_tpu_SECRET_4e1d" not in text and "HF_TOKEN" not in text
        env_flags = re.findall(r"--env\S*", "\n".join(scripts))
        # the container gets its HOME, unbuffered output and the worker's TPU variables by name: no values from here
        by_name = [f"--env={name}" for name in tpu_remote.WORKER_VARS]
        expected = ['--env=HOME="$PWD/workspace"', "--env=PYTHONUNBUFFERED=1", *by_name] if image else []
        assert env_flags == expected, env_flags


SBATCH_SCRIPT = ROOT / "slurm" / "train.sbatch"
SRUN_STUB = """#!/bin/sh
if [ "$1" = --help ]; then
    [ -n "$STUB_PYXIS" ] && echo "  --container-image=IMAGE"
    exit 0
fi
printf '%s\\0' "$@" >"$RECORD"
"""


@pytest.fixture(scope="module")
def slurm_stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with stand-ins for srun (records its argv) and the container runtimes (only have to exist)."""
    stubs = tmp_path_factory.mktemp("slurm-stubs")
    for name, text in {"srun": SRUN_STUB, "apptainer": "#!/bin/sh\nexit 99\n", "podman": "#!/bin/sh\nexit 99\n"}.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    return stubs


def podman_argv(here: str, image: str) -> list[str]:
    """What the podman runtime runs per task (no GPUs): the checkout at its own path, as the submitter,
    every SLURM_* / JOB_* / JAX_* / NCCL_* variable and XLA_FLAGS by name (values from the task)."""
    uid, gid = os.getuid(), os.getgid()
    return ["podman", "run", "--rm", "--init", "--network=host", "--ipc=host", f"--user={uid}:{gid}",
            *([] if uid == 0 else ["--userns=keep-id"]), f"--volume={here}:{here}", f"--workdir={here}",
            "--env=SLURM_*", "--env=SLURMD_NODENAME", "--env=JOB_*", "--env=JAX_*", "--env=XLA_FLAGS", "--env=NCCL_*",
            image]


@FEW
@given(words=ARGV, image=WORD.filter(bool), runtime=st.sampled_from(["none", "pyxis", "apptainer", "podman"]),
       auto=st.booleans(), cpus=st.sampled_from([None, "7"]))
def test_the_sbatch_script_hands_every_word_to_srun_verbatim(slurm_stubs: Path, words: list[str], image: str,
                                                             runtime: str, auto: bool, cpus: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        here = str(Path(tmp).resolve())
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        for name in ("srun", *([runtime] if runtime in ("apptainer", "podman") else [])):
            (bin_dir / name).symlink_to(slurm_stubs / name)
        # pyxis and apptainer are found by themselves (auto); podman only when asked for
        chosen = "auto" if auto and runtime != "podman" else runtime
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1",
               "JOB_PYTHON": "/venv/bin/python", "JOB_LOG_DIR": f"{here}/logs", "RECORD": f"{here}/argv",
               **({"IMAGE": image, "CONTAINER_RUNTIME": chosen} if runtime != "none" else {}),
               **({"STUB_PYXIS": "1"} if runtime == "pyxis" else {}), **({"SLURM_CPUS_PER_TASK": cpus} if cpus else {})}
        proc = shell(["bash", str(SBATCH_SCRIPT), *words], here, env)
        assert proc.returncode == 0, proc.stderr
        received = nul_split((Path(here) / "argv").read_bytes())
        (Path(here) / "argv").unlink()
        dry = shell(["bash", str(SBATCH_SCRIPT), *words], here, {**env, "JOB_DRY_RUN": "1"})
        assert dry.returncode == 0, dry.stderr
        assert not (Path(here) / "argv").exists(), "JOB_DRY_RUN=1 ran srun"
        assert not (Path(here) / PWNED).exists(), "a word ran as shell"
    args = words or ["train", "--run-dir", "runs/slurm"]
    expected = {
        "none": ["/venv/bin/python", "-m", "job", *args],
        "pyxis": [f"--container-image={image}", f"--container-mounts={here}:{here}", f"--container-workdir={here}",
                  "python", "-m", "job", *args],
        "apptainer": ["apptainer", "exec", "--bind", here, "--pwd", here, image, "python", "-m", "job", *args],
        "podman": [*podman_argv(here, image), "python", "-m", "job", *args],
    }[runtime]
    cpus_args = [f"--cpus-per-task={cpus}"] if cpus else []
    assert received == ["--kill-on-bad-exit=1", f"--output={here}/logs/%j-%t.log", *cpus_args, *expected]
    # the dry run prints the same command line, quoted so that a shell reads back the same words
    assert shlex.split(dry.stdout.decode()) == ["srun", *received]


PYTHON_STUB = "#!/bin/sh\nprintf '%s\\0' \"$@\" >\"$RECORD\"\n"
# A make command-line value is make syntax too: GNU make expands it when it exports it to a recipe's
# environment. So `$(shell ...)` in a value runs (make code, like any make command line: not generated
# here) and an unbalanced `$(` stops make before any recipe runs (allowed below: it runs nothing).
_MAKE_FUNCTION = re.compile(r"\$[({]\s*(shell|file|eval|call|guile|value|origin|foreach|let)\b")
_MAKE_REFUSES = b"unterminated variable reference"
MAKE_WORD = st.lists(st.one_of(st.sampled_from((*FRAGMENTS, "$(", "${", "$$", "$(x)", ")", "%", "$")),
                               st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)),
                                       max_size=6)), max_size=5).map("".join).filter(
    lambda v: "\n" not in v and not _MAKE_FUNCTION.search(v))  # a newline: the test after this one
MAKE_VALUE = MAKE_WORD.filter(lambda v: v == v.lstrip())  # make drops a value's leading blanks


def make_tpu(target: str, cwd: str, *, flags: Sequence[str] = (), **variables: str) -> subprocess.CompletedProcess[bytes]:
    """`make TARGET` of this repository's Makefile, with a `python` that records its argv instead of running."""
    stubs = Path(cwd) / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "python").write_text(PYTHON_STUB)
    (stubs / "python").chmod(0o755)
    argv = ["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), *flags, "-o", f"{stubs}/.installed",
            f"BIN={stubs}", target, *(f"{k}={v}" for k, v in variables.items())]
    return shell(argv, cwd, {"RECORD": f"{cwd}/argv"})


@FEW
@given(words=st.lists(MAKE_WORD, max_size=6), zone=MAKE_VALUE, image=MAKE_VALUE, name=MAKE_VALUE)
def test_make_tpu_targets_pass_each_value_on_as_one_word(words: list[str], zone: str, image: str, name: str) -> None:
    with tempfile.TemporaryDirectory() as here:
        proc = make_tpu("tpu-run", here, TPU_NAME=name, ZONE=zone, IMAGE=image, ARGS=shlex.join(words))
        ran = sorted(os.listdir(here))
        event(f"make exit code {proc.returncode}")
        if proc.returncode != 0:  # only for an unbalanced `$(`, and before anything ran
            assert _MAKE_REFUSES in proc.stderr and ran == ["bin"], (proc.stderr, ran)
            return
        assert ran == ["argv", "bin"], "a value ran as shell"
        received = nul_split((Path(here) / "argv").read_bytes())
    assert received[:3] == ["-m", "deploy.tpu", "run"]
    flags = dict(item.split("=", 1) for item in received[3:])
    assert (flags["--name"], flags["--zone"], flags["--image"]) == (name, zone, image)
    assert shlex.split(flags["--args"]) == words


SUBMIT_PAIRS = ["--nodes", "--partition", "--time", "--gpus-per-node", "--tasks-per-node", "--gpu-type",
                "--cpus-per-task", "--mem", "--constraint", "--account", "--qos", "--image", "--container-runtime",
                "--via"]


@FEW
@given(partition=MAKE_VALUE, qos=MAKE_VALUE, account=MAKE_VALUE, image=MAKE_VALUE, mem=MAKE_VALUE,
       constraint=MAKE_VALUE, python=MAKE_VALUE, gres=MAKE_VALUE, sbatch_args=MAKE_VALUE,
       words=st.lists(MAKE_WORD, max_size=6))
def test_make_submit_slurm_passes_each_value_on_as_one_word(partition: str, qos: str, account: str, image: str,
                                                            mem: str, constraint: str, python: str, gres: str,
                                                            sbatch_args: str, words: list[str]) -> None:
    with tempfile.TemporaryDirectory() as here:
        proc = make_tpu("submit-slurm", here, PARTITION=partition, QOS=qos, ACCOUNT=account, IMAGE=image, MEM=mem,
                        CONSTRAINT=constraint, PYTHON=python, GRES=gres, SBATCH_ARGS=sbatch_args,
                        ARGS=shlex.join(words))
        ran = sorted(os.listdir(here))
        if proc.returncode != 0:  # only for an unbalanced `$(`, and before anything ran
            assert _MAKE_REFUSES in proc.stderr and ran == ["bin"], (proc.stderr, ran)
            return
        assert ran == ["argv", "bin"], "a value ran as shell"
        received = nul_split((Path(here) / "argv").read_bytes())
    assert received[:2] == ["-m", "deploy.slurm"]
    end = 2 + 2 * len(SUBMIT_PAIRS)
    pairs = received[2:end]  # the recipe's `--flag value` pairs (a value may itself be "--")
    flags = dict(zip(pairs[::2], pairs[1::2], strict=True))
    assert list(flags) == SUBMIT_PAIRS
    assert [flags[f] for f in ("--partition", "--qos", "--account", "--image", "--mem", "--constraint")] == [
        partition, qos, account, image, mem, constraint]
    assert received[end:] == [f"--gres={gres}", "--exclusive=", "--dry-run=0", f"--python={python}",
                              f"--sbatch-args={sbatch_args}", "--wait=", "--sweep=", "--sweep-parallel=",
                              "--retries=3", "--spares=", f"--args={shlex.join(words)}"]
    assert shlex.split(received[-1].removeprefix("--args=")) == words


@pytest.mark.parametrize("variable", ["ARGS", "ZONE", "TPU_NAME"])
def test_a_newline_in_a_make_value_runs_nothing(variable: str) -> None:
    # GNU make ends the recipe line at the newline, inside the value's quotes: bash refuses the line.
    # (A make that kept the line whole would hand the value on verbatim: also fine.)
    value = f"x'\ntouch {PWNED}\n"
    with tempfile.TemporaryDirectory() as here:
        proc = make_tpu("tpu-run", here, **{variable: value})
        ran = Path(here) / "argv"
        assert not (Path(here) / PWNED).exists()
        if proc.returncode == 0:
            assert any(item.endswith("=" + value) for item in nul_split(ran.read_bytes()))
        else:
            assert not ran.exists() and b"unexpected EOF" in proc.stderr, proc.stderr


def test_make_dry_run_of_a_tpu_target_expands_no_make_code_in_args() -> None:
    # ARGS used to be expanded while the Makefile was read (SLURM_ARGS/DOCKER_ARGS `:=`), by every target.
    with tempfile.TemporaryDirectory() as here:
        proc = make_tpu("tpu-pod", here, flags=["-n"], TPU_NAME="pod-1", ARGS=f"$(shell touch {PWNED})")
        assert proc.returncode == 0, proc.stderr
        assert f"--args='$(shell touch {PWNED})'" in proc.stdout.decode()
        assert not (Path(here) / PWNED).exists()


# ---------------------------------------------------------------------------------------------------
# 3. The image runs as a fixed non-root user
# ---------------------------------------------------------------------------------------------------
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
SWITCH_USER = re.compile(r"(^|[\s;&|(`])(su|sudo|doas|gosu|su-exec|setpriv|runuser|chroot|capsh|setcap)(\s|$)",
                         re.MULTILINE)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    found, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        found.append((keyword.upper(), rest.strip()))
        pending = ""
    return found


def final_user_problem(text: str) -> str | None:
    """Why the final stage would run as root (None: it runs as a fixed non-root uid)."""
    steps = instructions(text)
    start = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    users = [rest for keyword, rest in steps[start:] if keyword == "USER"]
    if not users:
        return "the final stage has no USER: it runs as root"
    uid, _, gid = users[-1].partition(":")
    if not uid.isdigit():
        return f"USER {users[-1]}: expected a numeric uid (Kubernetes' runAsNonRoot can only check a number)"
    if int(uid) == 0 or gid in ("0", "root"):
        return f"USER {users[-1]} is root"
    return None


@pytest.mark.parametrize(("text", "problem"), [
    ("FROM a\nRUN true\n", "no USER"),
    ("FROM a\nUSER 10001\nUSER root\n", "numeric"),
    ("FROM a\nUSER 10001\nFROM b\nCMD x\n", "no USER"),
    ("FROM a\nUSER 0:0\n", "is root"),
    ("FROM a\nUSER 10001:0\n", "is root"),
    ("FROM a\nUSER job\n", "numeric"),
])
def test_the_user_check_catches_root(text: str, problem: str) -> None:
    assert problem in (final_user_problem(text) or "")


def test_the_image_runs_as_a_fixed_non_root_user_and_nothing_switches_back() -> None:
    text = DOCKERFILE.read_text()
    assert final_user_problem(text) is None, final_user_problem(text)
    steps = instructions(text)
    # The entrypoint that runs is docker/entrypoint.sh, and it cannot become root again.
    assert ("ENTRYPOINT", '["job-entrypoint"]') in steps
    assert any(k == "COPY" and v.endswith("docker/entrypoint.sh /usr/local/bin/job-entrypoint") for k, v in steps)
    code = "\n".join(line for line in ENTRYPOINT.read_text().splitlines() if not line.lstrip().startswith("#"))
    assert not SWITCH_USER.search(code), SWITCH_USER.search(code)
    runs = " ".join(v for k, v in steps if k == "RUN")
    assert not SWITCH_USER.search(runs) and not re.search(r"chmod\s+\S*[ugo]*\+s|chmod\s+[0-7]?[4-7][0-7]{3}\b",
                                                          runs), runs


def test_the_switch_user_check_sees_a_sudo() -> None:
    assert SWITCH_USER.search("set -eu\nexec sudo -u root python -m job\n")
    assert SWITCH_USER.search("exec gosu 0 \"$@\"")
    assert not SWITCH_USER.search('exec python -m job "$@"  # success')


# ---------------------------------------------------------------------------------------------------
# 4a. Nothing secret in the image: what .dockerignore lets into the build context
# ---------------------------------------------------------------------------------------------------
# Kept out of the image: files that usually hold a secret, at the top and inside job/ (which the image
# copies whole), and the checkout's other folders.
KEPT_OUT = (
    ".env", "id_rsa", ".netrc", ".git/config", ".venv/bin/python", "runs/local/config.json",
    "tests/unit/test_security.py", "job/.env", "job/.env.production", "job/.envrc", "job/server.pem",
    "job/sub/tls.key", "job/cert.p12", "job/id_rsa", "job/id_rsa.pub", "job/id_ed25519", "job/.ssh/config",
    "job/.netrc", "job/.git-credentials", "job/.pypirc", "job/credentials.json",
    "job/application_default_credentials.json", "job/my-service-account.json", "job/.aws/credentials",
    "job/.docker/config.json", "job/.kube/config", "job/.git/HEAD",
)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as the engines read it (moby's patternmatcher; buildah's is a copy)."""
    out, i = "^", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
            out += ".*" if i == len(pattern) else "(.*/)?"
            continue
        c = pattern[i]
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        elif c in "[]":
            out += c
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + "$")


def dockerignore(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(re-include?, regex) per line, in order."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        line = posixpath.normpath(line[1:].strip() if include else line)
        rules.append((include, _pattern_regex(line[1:] if line.startswith("/") and len(line) > 1 else line)))
    return rules


def ignored(rules: list[tuple[bool, re.Pattern[str]]], path: str) -> bool:
    """Whether the engine leaves `path` out of the build context: the last matching rule wins, and a
    rule that matches a parent folder matches everything in it."""
    parts = path.split("/")
    parents = ["/".join(parts[:i]) for i in range(1, len(parts))]
    matched = False
    for include, regex in rules:
        if include != matched:
            continue  # an exclusion of an excluded file, or a re-inclusion of a kept one, changes nothing
        if regex.match(path) or any(regex.match(p) for p in parents):
            matched = not include
    return matched


@pytest.mark.parametrize(("rules", "path", "expected"), [
    ("*", "job/a.py", True),
    ("*\n!job/", "job/a.py", False),
    ("*\n!job/\n**/.env", "job/sub/.env", True),
    ("**/.env", ".env", True),
    ("job", "job/deep/x", True),
    ("*.key", "job/a.key", False),  # `*` does not cross a /
    ("**/*.key", "job/a.key", True),
    ("/.git", ".git/config", True),
    ("*\n!docker/entrypoint.sh", "docker/run_local.py", True),
])
def test_the_dockerignore_reader_follows_the_engines_rules(rules: str, path: str, expected: bool) -> None:
    assert ignored(dockerignore(rules), path) is expected


def test_the_build_context_has_what_the_image_needs_and_no_secret() -> None:
    rules = dockerignore((ROOT / ".dockerignore").read_text())
    leaked = [path for path in KEPT_OUT if not ignored(rules, path)]
    assert not leaked, f"expected .dockerignore to keep these out of the image, found them in the context: {leaked}"
    needed = ["requirements.lock", "docker/requirements-cuda.lock", "docker/requirements-tpu.lock",
              "docker/entrypoint.sh", *(p.relative_to(ROOT).as_posix() for p in (ROOT / "job").rglob("*.py")
                                        if "__pycache__" not in p.parts)]
    missing = [path for path in needed if ignored(rules, path)]
    assert not missing, f"expected these in the build context, found them ignored: {missing}"


def test_the_image_copies_only_the_locks_the_entrypoint_and_job_and_bakes_in_no_secret() -> None:
    steps = instructions(DOCKERFILE.read_text())
    sources = [shlex.split(rest)[:-1] for keyword, rest in steps if keyword in ("COPY", "ADD")]
    sources = [[s for s in source if not s.startswith("--")] for source in sources]
    assert sources == [["${LOCK}"], ["docker/entrypoint.sh"], ["job"]], sources
    names = [rest.split("=")[0].split()[0] for keyword, rest in steps if keyword in ("ARG", "ENV")]
    names += re.findall(r"(?:^|\s)([A-Z_][A-Z0-9_]*)=", " ".join(rest for keyword, rest in steps if keyword == "ENV"))
    secretish = [n for n in names if re.search(r"TOKEN|SECRET|PASSW|API_?KEY|CREDENTIAL|AUTH", n)]
    assert not secretish, f"expected no secret in a build argument or image variable, found {secretish}"


def test_the_tpu_code_archive_ships_no_secret_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = tmp_path / "src"
    for path in ("job/model.py", "job/sub/data.py", "deploy/x.py",
                 *(p for p in KEPT_OUT if p.startswith("job/"))):
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text("hf_archive_SECRET_0b7e\n" if not path.endswith(".py") else "x = 1\n")
    cfg = TpuConfig(name="pod-1", zone="us-central2-b", source_dir=str(source), local_dir=str(tmp_path / "local"),
                    ship=("job", "deploy"))
    with caplog.at_level(logging.WARNING, logger="deploy.tpu"):
        archive = tpu_job.build_archive(cfg)
    with tarfile.open(archive) as tar:
        files = sorted(m.name for m in tar.getmembers() if m.isfile())
    assert files == ["deploy/x.py", "job/model.py", "job/sub/data.py"]
    assert b"hf_archive_SECRET_0b7e" not in gzip.decompress(archive.read_bytes())
    assert "not shipping job/.env" in caplog.text  # said, not silently dropped


# ---------------------------------------------------------------------------------------------------
# 4b-c, 5. Nothing secret in logs, run folders, checkpoints, submissions, gcloud argv
# ---------------------------------------------------------------------------------------------------
SECRETS = {
    "HF_TOKEN": "hf_SECRET_token_9c2f71",
    "WANDB_API_KEY": "wandb_SECRET_key_4a8e03",
    "AWS_SECRET_ACCESS_KEY": "aws_SECRET_key_51bd2c",
    "GITHUB_TOKEN": "ghp_SECRET_token_e07a96",
    "JOB_API_TOKEN": "job_SECRET_token_3f6d18",  # a JOB_* name: the container launcher forwards those by name
}


def files_under(root: Path) -> Iterator[Path]:
    return (p for p in sorted(root.rglob("*")) if p.is_file())


def holding(root: Path, needle: str) -> list[str]:
    """Files under `root` whose bytes contain `needle`."""
    return [str(p.relative_to(root)) for p in files_under(root) if needle.encode() in p.read_bytes()]


def leaks(texts: Mapping[str, str | bytes]) -> dict[str, list[str]]:
    """{where: [secret names found there]} for every text that holds a secret value."""
    found = {}
    for where, text in texts.items():
        data = text.encode() if isinstance(text, str) else text
        names = [name for name, value in SECRETS.items() if value.encode() in data]
        if names:
            found[where] = names
    return found


def test_the_leak_finder_finds_a_secret() -> None:
    assert leaks({"x": f"a {SECRETS['HF_TOKEN']} b", "y": b"nothing"}) == {"x": ["HF_TOKEN"]}


def test_a_slurm_submission_writes_no_secret_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    # submitit's own files (sbatch script, pickled task), written for real; only sbatch is a stand-in.
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in {"sbatch": 'echo "Submitted batch job 4242"', "srun": "exit 0"}.items():  # submitit looks for srun
        (stubs / name).write_text(f"#!/bin/sh\n{text}\n")
        (stubs / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    logs = tmp_path / "logs"
    cfg = slurm.SlurmConfig(nodes=2, log_dir=str(logs), args=("train", "--run-dir", "/shared/canary-81c4"))
    sub = slurm.submit(cfg, RecordingRunner(available=("sbatch",)))
    assert sub.job_id == "4242"
    assert holding(logs, "canary-81c4"), "expected the pickled task (with its arguments) under the log folder"
    assert any(p.suffix == ".sh" for p in files_under(logs)) and any(p.suffix == ".pkl" for p in files_under(logs))
    found = leaks({str(p.relative_to(logs)): p.read_bytes() for p in files_under(logs)})
    assert not found, f"expected no secret in submitit's files, found {found}"
    # The plain sbatch path: the argv names the variables it sets, never a value from the environment.
    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (0, "4243\n")})
    slurm.submit(dataclasses.replace(cfg, via="sbatch", image="docker://example/job:1"), runner)
    assert not leaks({"sbatch argv": "\n".join(runner.calls[0])})
    export = next(a for a in runner.calls[0] if a.startswith("--export="))
    assert [item.split("=")[0] for item in export.removeprefix("--export=").split(",")] == [
        "ALL", "JOB_LOG_DIR", "JOB_RETRIES", "JOB_NODES", "JOB_SUPERVISOR_PYTHON", "IMAGE", "CONTAINER_RUNTIME"]


@dataclasses.dataclass
class EnvRecordingRunner(RecordingRunner):
    """Also records the `env` each command would get (None: this process's own)."""

    envs: list[Mapping[str, str] | None] = dataclasses.field(default_factory=list)

    def run(self, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:  # type: ignore[override]
        self.envs.append(kwargs.get("env"))  # type: ignore[arg-type]
        return super().run(argv, **kwargs)


def test_the_tpu_path_puts_no_secret_in_a_gcloud_command_log_or_archive(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    describe = (*tpu_gcloud.TPU_VM, "describe")
    runtime = parse_accelerator("v4-8").default_runtime
    runner = EnvRecordingRunner(available=("gcloud",), responses={  # the quick checks' answers, then the slice's
        ("gcloud", "auth", "list"): (0, "someone@example.com\n"), ("gcloud", "config", "get-value"): (0, "proj\n"),
        (*tpu_gcloud.TPU_VM, "accelerator-types"): (0, "v4-8\n"), (*tpu_gcloud.TPU_VM, "versions"): (0, f"{runtime}\n"),
        describe: (0, "READY\tv4-8")})
    local = tmp_path / "local"
    with caplog.at_level(logging.DEBUG):
        code = tpu.main(["pod", "--name=pod-1", "--zone=us-central2-b", f"--local-dir={local}",
                         f"--source-dir={ROOT}", "--args=train --run-dir /shared/canary-2b9a"], runner=runner)
    assert code == 0, capsys.readouterr().err
    verbs = [" ".join(call[3:5]) if call[1] == "compute" else " ".join(call[1:3]) for call in runner.calls]
    # the quick checks; describe; is a job running?; ship; set up; start detached; follow worker 0's log; fetch
    assert verbs == ["auth list", "config get-value", "tpu-vm accelerator-types", "tpu-vm versions", "tpu-vm describe",
                     "tpu-vm ssh", "tpu-vm scp", "tpu-vm ssh", "tpu-vm ssh", "tpu-vm ssh", "tpu-vm scp"], verbs
    assert any("canary-2b9a" in item for item in runner.calls[8])  # the job's arguments do travel
    assert runner.envs == [None] * len(runner.calls)  # gcloud gets this process's environment, nothing added
    out = capsys.readouterr()
    archive = gzip.decompress((local / "pod-1" / tpu_job.ARCHIVE).read_bytes())
    found = leaks({"gcloud argv": "\n".join("\n".join(c) for c in runner.calls), "stdout": out.out,
                   "stderr": out.err, "log": caplog.text, "code archive": archive})
    assert not found, f"expected no secret on the TPU path, found {found}"


def _load_run_local() -> types.ModuleType:
    """docker/run_local.py is a script, not a package: load it by path (once, as test_static does)."""
    if "run_local" in sys.modules:
        return sys.modules["run_local"]
    spec = importlib.util.spec_from_file_location("run_local", ROOT / "docker" / "run_local.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_local"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_local_containers_get_variables_by_name_never_by_value_on_the_command_line(tmp_path: Path) -> None:
    run_local = _load_run_local()
    run = run_local.ContainerRun(engine="podman", image="job:cpu", num_processes=2, job_args=("train",),
                                 runs_dir=tmp_path)
    envs = run_local.rank_environments(run, 4321, {"PATH": "/usr/bin", **SECRETS})
    names = run_local.forwarded(envs[0])
    assert not {"HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN"} & set(names), names
    argv = run_local.container_argv(run, names, "tok", [])
    assert "--env=JOB_API_TOKEN" in argv  # a JOB_* variable is passed by name: its value is not in the argv
    assert not leaks({"container argv": "\n".join(argv)})
