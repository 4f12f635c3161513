"""deploy.slurm.submit without a cluster: validation, GPU layouts, golden sbatch scripts and argv, dry runs."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import submitit.slurm.slurm as submitit_slurm

from deploy import sweeps
from deploy.runner import Runner
from deploy.slurm import options as slurm_options
from deploy.slurm import submit as slurm
from deploy.slurm import task as slurm_task
from deploy.slurm.partitions import PARTITION_ARGV
from job.core import exits
from job.errors import ConfigError
from job.runtime.cluster.base import SKIP_GPU_CHECK
from job.runtime.preemption import SIGNALS
from tests.doubles import PARTITION, RecordingRunner
from tests.golden import check_golden

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
NO_CONTROLLER = ("sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
                 "sbatch: fatal: Could not establish a configuration source\n")


def normalized(text: str) -> str:
    """Machine paths -> fixed ones: the checkout is /repo, this interpreter /venv/bin/python."""
    return text.replace(sys.executable, "/venv/bin/python").replace(str(ROOT), "/repo")


@pytest.fixture(autouse=True)
def _no_gpu_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SKIP_GPU_CHECK, raising=False)


# ---------------------------------------------------------------------------------------------------- checks
@pytest.mark.parametrize(
    ("text", "minutes"),
    [("30", 30), ("90:30", 91), ("01:00:00", 60), ("2-00", 2880), ("1-02:30", 1590), ("0-00:00:59", 1)],
)
def test_slurm_time_formats(text: str, minutes: int) -> None:
    assert slurm.time_minutes(text) == minutes


@pytest.mark.parametrize("text", [" ", "1:2:3:4", "abc", "1h", "-5"])
def test_bad_time_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="TIME: expected MM, MM:SS, HH:MM:SS"):
        slurm.time_minutes(text)


@pytest.mark.parametrize("text", ["0", "00:00:00"])
def test_zero_time_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="TIME: expected a positive duration"):
        slurm.time_minutes(text)


@pytest.mark.parametrize(("nodes", "found"), [("0", "'0'"), ("abc", "'abc'"), ("-2", "'-2'"), ("1.5", "'1.5'")])
def test_bad_nodes_is_one_clear_error_and_nothing_runs(nodes: str, found: str, capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=("sbatch",))
    assert slurm.main(["--nodes", nodes], runner=runner) == 2
    assert f"NODES: expected a whole number >= 1, found {found}" in capsys.readouterr().err
    assert runner.calls == []


def test_missing_sbatch_says_how_to_start_the_local_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=())
    assert slurm.main(["--nodes", "4"], runner=runner) == 2
    err = capsys.readouterr().err
    assert "expected Slurm's sbatch on PATH, found 'no sbatch'" in err
    assert "make slurm-up NODES=4" in err
    assert runner.calls == []


def test_unknown_partition_lists_the_real_ones(capsys: pytest.CaptureFixture[str]) -> None:
    listing = PARTITION + PARTITION.replace("debug", "gpu").replace("Default=YES", "Default=NO")
    runner = RecordingRunner(available=("sbatch",), responses={PARTITION_ARGV: (0, listing)})
    assert slurm.main(["--nodes", "2", "--partition", "big"], runner=runner) == 2
    assert "PARTITION: expected one of debug, gpu, found 'big'" in capsys.readouterr().err
    assert runner.calls == [list(PARTITION_ARGV)]


def actions(runner: RecordingRunner) -> list[list[str]]:
    """The calls after the read-only partition queries every submission makes first (deploy/slurm/partitions.py)."""
    return [call for call in runner.calls if call[0] not in ("scontrol", "sinfo")]


def test_bad_via_and_gpus_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=("sbatch",))
    assert slurm.main(["--via", "ssh"], runner=runner) == 2
    assert slurm.main(["--gpus-per-node", "x"], runner=runner) == 2
    err = capsys.readouterr().err
    assert "VIA: expected submitit or sbatch, found 'ssh'" in err
    assert "GPUS_PER_NODE: expected a whole number >= 0, found 'x'" in err


def test_make_style_empty_values_mean_unset() -> None:
    cfg = slurm.parse(["--nodes", "4", "--partition", "", "--time", "", "--gpus-per-node", "", "--qos", "",
                       "--tasks-per-node", "", "--gpu-type", "", "--mem", "", "--constraint", "", "--python", "",
                       "--container-runtime", "", "--gres=", "--exclusive=", "--dry-run=0", "--sbatch-args=",
                       "--via", "", "--", "train", "--steps", "5"])
    assert cfg == slurm.SlurmConfig(nodes=4, args=("train", "--steps", "5"))


def test_every_make_variable_reaches_its_field() -> None:
    cfg = slurm.parse(["--nodes=2", "--gpus-per-node=8", "--tasks-per-node=2", "--gpu-type=h100", "--gres=1",
                       "--cpus-per-task=12", "--mem=500M", "--exclusive", "--constraint=ib", "--image=img:cuda",
                       "--container-runtime=podman", "--python=/opt/py", "--sbatch-args=--begin=now --hold",
                       "--dry-run=1", "--via=sbatch"])
    assert (cfg.gpus_per_node, cfg.tasks_per_node, cfg.ntasks_per_node, cfg.gpu_type, cfg.gres) == (8, 2, 2, "h100", True)
    assert (cfg.cpus_per_task, cfg.mem, cfg.exclusive, cfg.constraint) == (12, "500M", True, "ib")
    assert (cfg.image, cfg.container_runtime, cfg.python, cfg.dry_run) == ("img:cuda", "podman", "/opt/py", True)
    assert cfg.sbatch_args == ("--begin=now", "--hold")


@pytest.mark.parametrize(("cfg", "needle"), [
    (slurm.SlurmConfig(gpus_per_node=4, tasks_per_node=3), "TASKS_PER_NODE: expected a divisor of GPUS_PER_NODE=4"),
    (slurm.SlurmConfig(gpu_type="a100"), "GPU_TYPE: expected GPUS_PER_NODE > 0 with it"),
    (slurm.SlurmConfig(gres=True), "GRES: expected GPUS_PER_NODE > 0 with it"),
    (slurm.SlurmConfig(gpus_per_node=4, gpu_type="a100:2"), "GPU_TYPE: expected one GRES type name"),
    (slurm.SlurmConfig(mem="64GiB"), "MEM: expected memory per node in Slurm's form"),
    (slurm.SlurmConfig(constraint="a b"), "CONSTRAINT"),
    (slurm.SlurmConfig(container_runtime="docker", image="x"), "CONTAINER_RUNTIME: expected auto or pyxis"),
    (slurm.SlurmConfig(container_runtime="podman"), "CONTAINER_RUNTIME: expected IMAGE with it"),
    (slurm.SlurmConfig(python="/a,LD_PRELOAD=/x.so"), "PYTHON: expected an interpreter path"),
])
def test_inconsistent_values_are_one_error_naming_the_make_variable(cfg: slurm.SlurmConfig, needle: str) -> None:
    with pytest.raises(ConfigError, match="Fix:") as caught:
        slurm_options.check(cfg)
    assert needle in str(caught.value)


# ---------------------------------------------------------------------------------------------------- GPU layouts
LAYOUTS = [  # (G, T, GPU_TYPE, GRES) -> the tasks per node and the one option that asks for the GPUs
    ((0, None, None, False), 1, None),
    ((0, 4, None, False), 4, None),
    ((4, 1, None, False), 1, ("gpus-per-node", "4")),
    ((4, 1, "a100", False), 1, ("gpus-per-node", "a100:4")),
    ((4, None, None, False), 4, ("gpus-per-task", "1")),
    ((8, 4, "h100", False), 4, ("gpus-per-task", "h100:2")),
    ((4, None, None, True), 4, ("gres", "gpu:4")),
    ((4, 1, "a100", True), 1, ("gres", "gpu:a100:4")),
]


@pytest.mark.parametrize(("layout", "tasks", "asked"), LAYOUTS)
def test_each_gpu_layout_asks_the_same_on_both_paths(layout: tuple, tasks: int, asked: tuple | None) -> None:
    g, t, kind, gres = layout
    cfg = slurm.SlurmConfig(gpus_per_node=g, tasks_per_node=t, gpu_type=kind, gres=gres)
    assert cfg.ntasks_per_node == tasks and slurm_options.gpu_request(cfg) == asked
    params = slurm.submitit_parameters(cfg, {})
    argv = slurm.sbatch_argv(cfg)
    assert params["ntasks_per_node"] == tasks and f"--ntasks-per-node={tasks}" in argv
    gpu_words = [a for a in argv if a.startswith(("--gpus", "--gres"))]
    gpu_params = {k: v for k, v in params.items() if k in ("gpus_per_node", "gpus_per_task", "gres")}
    if asked is None:
        assert gpu_words == [] and gpu_params == {}
    else:
        assert gpu_words == [f"--{asked[0]}={asked[1]}"]
        assert gpu_params == {asked[0].replace("-", "_"): asked[1]}
        line = f"#SBATCH --{asked[0]}={asked[1]}"
        assert line in submitit_slurm._make_sbatch_string(command="x", folder="/logs", **params)


def test_both_paths_ask_for_requeue_and_give_srun_the_cpus_per_task() -> None:
    cfg = slurm.SlurmConfig(nodes=2, cpus_per_task=6)
    script = slurm.submitit_script(cfg, {})
    assert "#SBATCH --requeue" in script and "#SBATCH --export=ALL" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=1 --cpus-per-task=6 " in srun
    argv = slurm.sbatch_argv(dataclasses.replace(cfg, via="sbatch"))
    assert "--requeue" in argv and "--cpus-per-task=6" in argv
    assert "--cpus-per-task=6" in slurm.srun_line(cfg, Runner(), {"PATH": os.environ["PATH"]}).split()


@pytest.mark.parametrize(("given", "expected"), [
    ("", "--xla_gpu_enable_latency_hiding_scheduler=true"),
    ("--xla_dump_to=/tmp/d", "--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding_scheduler=true"),
    ("--xla_gpu_enable_latency_hiding_scheduler=false", "--xla_gpu_enable_latency_hiding_scheduler=false"),
    (" --xla_gpu_enable_latency_hiding_scheduler ", "--xla_gpu_enable_latency_hiding_scheduler"),
])
def test_gpu_xla_flags_join_xla_flags_without_overriding_the_users(given: str, expected: str) -> None:
    assert slurm_options.with_gpu_xla_flags(given) == expected


def test_gpu_xla_flags_are_set_only_on_the_gpu_path_and_on_both_paths() -> None:
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    exports = [line for line in slurm.submitit_parameters(slurm.SlurmConfig(), environ)["setup"]
               if line.startswith("export ")]
    assert exports == ["export JOB_LOG_DIR=runs/slurm-logs", "export JOB_RETRIES=3", "export JOB_NODES=1",
                       f"export JOB_SUPERVISOR_PYTHON={sys.executable}"]  # the supervisor's (deploy/slurm/supervise.py)
    gpu = slurm.SlurmConfig(gpus_per_node=4)
    assert [line for line in slurm.submitit_parameters(gpu, environ)["setup"] if "XLA_FLAGS" in line] == [
        "export XLA_FLAGS='--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding_scheduler=true'"]
    assert slurm_options.task_environment(gpu, environ) == {
        "XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding_scheduler=true"}
    assert slurm.batch_environment(gpu, environ)["XLA_FLAGS"].endswith("scheduler=true")


def test_every_gpu_xla_flag_is_known_to_this_jaxlib() -> None:
    # jaxlib aborts on an unknown flag in XLA_FLAGS ("Unknown flag in XLA_FLAGS"): a CPU process proves the names.
    flags = slurm_options.with_gpu_xla_flags("")
    proc = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                          env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------------- the CUDA interpreter
def gpu_runner(probe_exit: int) -> RecordingRunner:
    return RecordingRunner(available=("sbatch",), responses={("/opt/cpu-only/python",): (probe_exit, "")})


def test_gpus_without_a_cuda_interpreter_is_one_error_before_anything_is_submitted(
        capsys: pytest.CaptureFixture[str]) -> None:
    runner = gpu_runner(3)
    assert slurm.main(["--gpus-per-node=4", "--python=/opt/cpu-only/python", "--via=sbatch"], runner=runner) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PYTHON: expected an interpreter with jax's CUDA plugin" in err
    assert "found '/opt/cpu-only/python without jax-cuda12-plugin'" in err
    assert "make venv FLAVOR=cuda" in err and "IMAGE=...:cuda" in err and "JOB_SKIP_GPU_CHECK=1" in err
    assert actions(runner) == [["/opt/cpu-only/python", "-c", slurm_options.GPU_PROBE]]  # the probe only: no sbatch


def test_the_default_gpu_interpreter_is_the_cuda_venv_and_a_missing_one_says_how_to_build_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_options, "CUDA_PYTHON", tmp_path / ".venv-cuda" / "bin" / "python")
    assert slurm.SlurmConfig(gpus_per_node=4).task_python == str(tmp_path / ".venv-cuda" / "bin" / "python")
    assert slurm.SlurmConfig().task_python == sys.executable
    assert slurm.main(["--gpus-per-node=4", "--dry-run"], runner=Runner()) == 2  # the real probe: no such file
    err = capsys.readouterr().err
    assert "which does not run" in err and "make venv FLAVOR=cuda" in err


@pytest.mark.parametrize("argv", [["--image=docker://x/job:cuda"], []])
def test_the_gpu_check_is_skipped_with_an_image_or_the_override(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    if not argv:
        monkeypatch.setenv(SKIP_GPU_CHECK, "1")
    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (0, "7\n")})
    assert slurm.main(["--gpus-per-node=4", "--via=sbatch", f"--log-dir={tmp_path}", *argv], runner=runner) == 0
    assert [call[0] for call in actions(runner)] == ["sbatch"]


def test_the_gpu_probe_accepts_an_interpreter_with_the_plugin(tmp_path: Path) -> None:
    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (0, "7\n")})  # the probe answers 0
    assert slurm.main(["--gpus-per-node=4", "--python=/opt/cuda/python", "--via=sbatch", f"--log-dir={tmp_path}"],
                      runner=runner) == 0
    assert [call[0] for call in actions(runner)] == ["/opt/cuda/python", "sbatch"]
    assert f"--export=ALL,JOB_PYTHON=/opt/cuda/python,JOB_LOG_DIR={tmp_path},JOB_RETRIES=3,JOB_NODES=1,JOB_SUPERVISOR_PYTHON={sys.executable}" in actions(runner)[1]


# ---------------------------------------------------------------------------------------------------- SBATCH_ARGS
def test_sbatch_args_reach_both_paths_word_for_word() -> None:
    cfg = slurm.SlurmConfig(sbatch_args=("--begin=now+1hour", "--mail-type=END,FAIL", "--hold", "--comment=a b #1"))
    argv = slurm.sbatch_argv(cfg)
    assert argv[argv.index("--begin=now+1hour"):][:4] == list(cfg.sbatch_args)
    script = slurm.submitit_script(cfg, {})
    for line in ("#SBATCH --begin=now+1hour", "#SBATCH --mail-type=END,FAIL", "#SBATCH --hold",
                 "#SBATCH --comment='a b #1'"):  # sbatch reads the quotes; '#' inside them starts no comment
        assert line in script.splitlines()


@pytest.mark.parametrize(("word", "fix"), [
    ("--nodes=9", "--nodes: use NODES=N"),
    ("--ntasks-per-node=8", "use TASKS_PER_NODE"),
    ("--ntasks-per-n=8", "--ntasks-per-node: use TASKS_PER_NODE"),  # sbatch would take the abbreviation
    ("--gpus-per-node=8", "use GPUS_PER_NODE"),
    ("--gres=gpu:8", "use GRES=1"),
    ("--mem=1G", "use MEM"),
    ("--exclusive", "use EXCLUSIVE=1"),
    ("--export=ALL,LD_PRELOAD=/tmp/x.so", "export the variable in the shell"),
    ("--exp=NONE", "--export"),
    ("--output=/tmp/x", "use --log-dir"),
    ("--wrap=id", "use ARGS"),
    ("--no-requeue", "make submit-slurm sets it"),
    ("--array=0-3", "not an array"),
])
def test_sbatch_args_that_we_set_ourselves_are_refused_with_the_variable_to_use(word: str, fix: str) -> None:
    with pytest.raises(ConfigError, match="SBATCH_ARGS: expected sbatch options that make submit-slurm does not") as e:
        slurm_options.check(slurm.SlurmConfig(sbatch_args=(word,)))
    assert fix in str(e.value)


@pytest.mark.parametrize("word", ["-N", "-N4", "begin=now", "--Begin=now", "--begin=", "--comment=a\nb",
                                  "--comment=a\\nb", "--comment=\x00", "--", "--=x"])
def test_sbatch_args_words_must_be_long_options_with_plain_values(word: str) -> None:
    with pytest.raises(ConfigError, match="SBATCH_ARGS"):
        slurm_options.check(slurm.SlurmConfig(sbatch_args=(word,)))


# ---------------------------------------------------------------------------------------------------- no controller
@pytest.mark.parametrize("output", [NO_CONTROLLER, "sbatch: error: Batch job submission failed: Unable to contact "
                                                   "slurm controller (connect failure)\n"])
def test_no_controller_is_one_line_with_the_fix_and_exit_2(output: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (1, output)})
    assert slurm.main(["--via=sbatch", f"--log-dir={tmp_path}"], runner=runner) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "expected a Slurm controller that sbatch can reach" in err
    assert "login node" in err and "make slurm-up NODES=4" in err


def test_no_controller_for_the_partition_query_is_the_same_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    said = NO_CONTROLLER.replace("sbatch", "scontrol")
    runner = RecordingRunner(available=("sbatch",), responses={("scontrol",): (1, said)})
    assert slurm.main(["--partition=gpu"], runner=runner) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a Slurm controller that scontrol can reach" in err


def test_no_controller_on_the_submitit_path_is_the_same_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in {"sbatch": f"printf '{NO_CONTROLLER}' >&2; exit 1", "srun": "exit 0"}.items():
        (stubs / name).write_text(f"#!/bin/sh\n{text}\n")
        (stubs / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    assert slurm.main([f"--log-dir={tmp_path / 'logs'}"], runner=RecordingRunner(available=("sbatch",))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "found 'sbatch: fatal: Could not establish a configuration source'" in err


def test_another_sbatch_failure_is_one_line_with_sbatch_s_own_words(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    said = "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified"
    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (1, said + "\n")})
    assert slurm.main(["--via=sbatch", f"--log-dir={tmp_path}"], runner=runner) == 1
    assert capsys.readouterr().err == f"error: sbatch failed (exit 1): {said}\n"


# ---------------------------------------------------------------------------------------------------- dry runs
def test_dry_run_prints_submitit_s_script_and_submits_nothing(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    import submitit

    monkeypatch.setattr(submitit, "SlurmExecutor", None)  # would raise if used
    runner = RecordingRunner(available=("sbatch",))
    assert slurm.main(["--nodes=2", "--dry-run", "--log-dir=/logs", "--", "train", "--steps", "5"], runner=runner) == 0
    out = capsys.readouterr().out
    assert out == slurm.submitit_script(slurm.parse(["--nodes=2", "--log-dir=/logs"]), os.environ)
    assert actions(runner) == []  # the partition queries only


def test_dry_run_of_the_sbatch_path_prints_the_command_and_the_srun_line(capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=())  # no Slurm here: a dry run still shows what would be sent
    assert slurm.main(["--via=sbatch", "--dry-run=1", "--cpus-per-task=3"], runner=Runner()) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# sbatch command" and out[1].startswith("sbatch --parsable ") and "--cpus-per-task=3" in out[1]
    assert out[3].startswith("srun --kill-on-bad-exit=1 ") and "--cpus-per-task=3" in out[3]
    assert slurm.main(["--via=sbatch", "--dry-run"], runner=runner) == 0
    assert [c[:1] for c in runner.calls] == [["bash"]]  # only train.sbatch in JOB_DRY_RUN mode


# ---------------------------------------------------------------------------------------------------- golden files
CPU = slurm.SlurmConfig(nodes=4, partition="debug", time="02:00:00", account="proj", qos="normal", cpus_per_task=8,
                        mem="64G", log_dir="/logs")
GPU_PER_NODE = slurm.SlurmConfig(nodes=2, time="1-00:00:00", gpus_per_node=4, tasks_per_node=1, cpus_per_task=32,
                                 exclusive=True, log_dir="/logs")
GPU_PER_TASK = slurm.SlurmConfig(nodes=2, gpus_per_node=4, tasks_per_node=4, gpu_type="a100", cpus_per_task=8,
                                 constraint="a100&ib", sbatch_args=("--mail-type=END,FAIL",), log_dir="/logs")
GOLDEN_CASES = {"cpu": CPU, "gpu_per_node": GPU_PER_NODE, "gpu_per_task": GPU_PER_TASK}
# On the sbatch path: the CPU job, the per-node GPU job in an image (apptainer, a run folder outside the
# checkout, an odd job argument) and the per-task GPU job from .venv-cuda.
SBATCH_CASES = {
    "cpu": dataclasses.replace(CPU, via="sbatch", log_dir="runs/slurm-logs"),
    "gpu_per_node": dataclasses.replace(GPU_PER_NODE, via="sbatch", log_dir="runs/slurm-logs",
                                        image="docker://example/job:cuda",
                                        container_runtime="apptainer",
                                        args=("train", "--run-dir", "/shared/runs/a", "--name", "a b; $(id)")),
    "gpu_per_task": dataclasses.replace(GPU_PER_TASK, via="sbatch", log_dir="runs/slurm-logs"),
}
ENVIRON = {"PATH": os.environ["PATH"], "XLA_FLAGS": "--xla_dump_to=/tmp/hlo"}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_submitit_script(case: str) -> None:
    cfg = GOLDEN_CASES[case]
    text = normalized(slurm.submitit_script(cfg, ENVIRON))
    assert "#SBATCH --requeue" in text and f"#SBATCH --ntasks-per-node={cfg.ntasks_per_node}" in text
    assert ("XLA_FLAGS" in text) == bool(cfg.gpus_per_node)
    check_golden(GOLDEN / f"submitit_{case}.sbatch", text)


@pytest.mark.parametrize("case", sorted(SBATCH_CASES))
def test_golden_sbatch_argv_and_srun_line(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # train.sbatch's $PWD
    cfg = SBATCH_CASES[case]
    extra = slurm_options.task_environment(cfg, ENVIRON)
    argv = slurm.sbatch_argv(cfg)
    assert argv[-len(cfg.args):] == list(cfg.args)  # user arguments stay separate argv items
    srun = slurm.srun_line(cfg, Runner(), ENVIRON)
    text = "\n".join([*(f"{k}={v}" for k, v in extra.items()), *argv]) + f"\n\n{srun}\n"
    check_golden(GOLDEN / f"sbatch_{case}.argv", normalized(text))


def test_the_dry_run_shows_the_golden_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cfg = SBATCH_CASES["gpu_per_task"]
    lines = slurm.dry_run(cfg, Runner(), ENVIRON).splitlines()
    extra = slurm_options.task_environment(cfg, ENVIRON)
    assert lines[1] == shlex.join(["env", *(f"{k}={v}" for k, v in extra.items()), *slurm.sbatch_argv(cfg)])
    assert lines[3] == slurm.srun_line(cfg, Runner(), ENVIRON)


# ---------------------------------------------------------------------------------------------------- submitting
def test_sbatch_submission_goes_through_the_runner(tmp_path: Path) -> None:
    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (0, "1234\n")})
    cfg = slurm.SlurmConfig(nodes=2, via="sbatch", log_dir=str(tmp_path))
    sub = slurm.submit(cfg, runner)
    assert sub.job_id == "1234" and sub.log == tmp_path / "1234-0.log"
    assert runner.calls[0][:3] == ["sbatch", "--parsable", "--job-name=jax-job"]


def test_the_gpu_sbatch_submission_carries_the_xla_flags_in_its_environment(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    envs: list[object] = []

    class Recording(RecordingRunner):
        def run(self, argv, **kwargs):  # type: ignore[no-untyped-def, override]
            envs.append(kwargs.get("env"))
            return super().run(argv, **kwargs)

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    runner = Recording(available=("sbatch",), responses={("sbatch",): (0, "5\n")})
    slurm.submit(slurm.SlurmConfig(gpus_per_node=2, via="sbatch", log_dir=str(tmp_path)), runner)
    env = envs[0]
    assert isinstance(env, dict) and env["NCCL_DEBUG"] == "INFO"  # sbatch --export=ALL passes it on
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding_scheduler=true"
    slurm.submit(slurm.SlurmConfig(via="sbatch", log_dir=str(tmp_path)), runner)
    assert envs[1] is None  # CPU: this process's own environment, nothing added


def test_args_as_one_shell_style_string_as_make_passes_them() -> None:
    from deploy.slurm.submit import parse

    assert parse(["--args=train --name 'a b; $(id)' ;"]).args == ("train", "--name", "a b; $(id)", ";")
    assert parse(["--args=train", "--", "demo"]).args == ("demo",)  # words after -- win
    assert parse([]).args == ("train", "--run-dir", "runs/slurm")
    with pytest.raises(SystemExit):
        parse(["--args=train --name 'open"])
    with pytest.raises(SystemExit):
        parse(["--sbatch-args=--comment='open"])


# ---------------------------------------------------------------------------------------------------- make venv FLAVOR=cuda
def test_make_venv_flavor_cuda_builds_venv_cuda_from_the_cuda_lock_and_cpu_is_unchanged() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VENV", "FLAVOR", "MAKEFLAGS", "MAKELEVEL")}

    def recipe(*variables: str) -> list[str]:
        proc = subprocess.run(["make", "--no-print-directory", "-n", "-B", "venv", *variables], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stdout.splitlines() if not line.startswith("[ -n ")]  # the FLAVOR guard

    def made(venv: str, lock: str) -> list[str]:
        return [
            "python3 -m venv --clear " + venv,
            f"{venv}/bin/pip install --quiet --disable-pip-version-check -r {lock}",
            f"{venv}/bin/pip install --quiet --disable-pip-version-check --no-deps -e .",
            f"{venv}/bin/python -c 'import sys; print(sys.version.split()[0], sys.base_prefix)' > {venv}/bin/.installed",
        ]

    assert recipe("FLAVOR=cuda")[1:] == made(".venv-cuda", "docker/requirements-cuda.lock")
    assert recipe()[1:] == made(".venv", "requirements.lock")
    assert "expected PYTHON to be Python 3.11 or newer" in recipe()[0]  # checked before anything is made
    proc = subprocess.run(["make", "venv", "FLAVOR=tpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "expected FLAVOR=cpu or FLAVOR=cuda, found FLAVOR=tpu" in proc.stderr


@pytest.mark.parametrize(("stamp", "given", "remade"), [
    ("0.0.0 /elsewhere", True, True),  # made with another interpreter: PYTHON=... makes it again
    (None, True, False),  # made with this one
    ("0.0.0 /elsewhere", False, False),  # no PYTHON given: whatever .venv has stays
])
def test_make_venv_python_makes_a_venv_of_another_interpreter_again(tmp_path: Path, stamp: str | None,
                                                                   given: bool, remade: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VENV", "FLAVOR", "MAKEFLAGS", "MAKELEVEL")}
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    this = subprocess.run([sys.executable, "-c", "import sys; print(sys.version.split()[0], sys.base_prefix)"],
                          capture_output=True, text=True, check=True).stdout
    (venv / "bin" / ".installed").write_text(stamp + "\n" if stamp else this)
    argv = ["make", "--no-print-directory", "-n", "venv", f"VENV={venv}", *([f"PYTHON={sys.executable}"] * given)]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (f"-m venv --clear {venv}" in proc.stdout) is remade, proc.stdout
    assert ("was made with Python 0.0.0; making it again with" in proc.stderr) is remade, proc.stderr


# ---------------------------------------------------------------------------------------------------- requeue
STAND_INS = {
    # srun: says which task failed where, as srun does (a task's own code, or the signal that killed it), and
    # ends as the tasks did (SRUN_CODE)
    "srun": 'echo "srun $*" >> "$CALLS"\n'
            'if [[ -n $SRUN_CODES ]]; then codes=($SRUN_CODES); n=$(grep -c "^srun " "$CALLS");\n'
            '  SRUN_CODE=${codes[n-1]:-0}; fi\n'
            'if [[ -n $FIRST ]]; then said=$FIRST; elif ((SRUN_CODE == 137)); then said=Killed;\n'
            'else said="Exited with exit code $SRUN_CODE"; fi\n'
            '[[ $SRUN_CODE == 0 ]] || echo "srun: error: node2: task 1: $said" >&2\n'
            '[[ $SRUN_CODE == 0 ]] || echo "srun: error: node1: task 0: Terminated" >&2\n'
            'exit "$SRUN_CODE"\n',
    # scontrol: only the forms the supervisor uses, as Slurm takes them; the rest is refused. REQUEUE=0: the job
    # has no requeue flag (JobRequeue=0, --no-requeue) and Slurm refuses to requeue it.
    "scontrol": 'case "$*" in\n'
                '  "requeue $SLURM_JOB_ID") [[ ${REQUEUE:-1} == 1 ]] || { echo "scontrol: error: Requested operation '
                'is presently disabled for job $SLURM_JOB_ID" >&2; exit 1; } ;;\n'
                '  "show job $SLURM_JOB_ID") echo "   ReqNodeList=(null) ExcNodeList=${EXCLUDED:-(null)}";\n'
                '    echo "   Requeue=${REQUEUE:-1} Restarts=$SLURM_RESTART_COUNT BatchFlag=1"; exit 0 ;;\n'
                '  "update JobId=$SLURM_JOB_ID ExcNodeList="*) ;;\n'
                '  *) echo "scontrol: invalid command: $*" >&2; exit 1 ;;\n'
                'esac\necho "scontrol $*" >> "$CALLS"\n',
    "sinfo": '[[ "$*" == "-h -p debug -N -o %N" ]] || { echo "sinfo: bad $*" >&2; exit 1; }\n'
             'printf "node%s\\n" 1 2 3 4 4\n',
}


def _batch_script(route: str, tmp_path: Path, retries: int = 3, spares: int = 0) -> list[str]:
    if route == "sbatch":
        return ["bash", str(slurm.SBATCH_SCRIPT), "train", "--run-dir", str(tmp_path / "run")]
    script = tmp_path / "submitit.sbatch"
    cfg = slurm.SlurmConfig(nodes=2, log_dir=str(tmp_path / "logs"), retries=retries, spares=spares)
    script.write_text(slurm.submitit_script(cfg, {}))
    return ["bash", str(script)]


def _run_batch(route: str, tmp_path: Path, code: int, *, retries: int = 3, excluded: str = "", restart: int = 2,
               first: str = "", spares: int = 0, codes: str = "", requeue: int = 1
               ) -> tuple[subprocess.CompletedProcess[str], list[str], list[dict]]:
    """The batch script of `route` with stand-ins for srun, scontrol and sinfo: a job of 2 nodes (+ `spares`)
    whose steps end with `code` (or each with the next of `codes`); the stand-ins' calls and the job's records."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "CALLS": str(calls),
           "SRUN_CODE": str(code), "SRUN_CODES": codes, "REQUEUE": str(requeue), "JOB_NODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": f"node[1-{2 + spares}]",
           "SLURM_RESTART_COUNT": str(restart), "JOB_LOG_DIR": str(tmp_path / "logs"), "JOB_RETRIES": str(retries),
           "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_NUM_NODES": str(2 + spares), "EXCLUDED": excluded,
           "FIRST": first}
    proc = subprocess.run(_batch_script(route, tmp_path, retries, spares), env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    record = tmp_path / "logs" / "4242-attempts.jsonl"
    records = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return proc, calls.read_text().splitlines(), records


@pytest.mark.parametrize("route", ["sbatch", "submitit"])
@pytest.mark.parametrize("code", [75, 0, 1, 137, 2])
def test_both_batch_scripts_requeue_a_preempted_job_and_retry_a_failed_one_away_from_its_node(
        route: str, code: int, tmp_path: Path) -> None:
    proc, recorded, records = _run_batch(route, tmp_path, code)
    assert proc.returncode == code, proc.stderr  # srun's status is the batch step's, requeued or not
    assert recorded[0].startswith("srun ") and "--kill-on-bad-exit=1" in recorded[0]
    assert "srun: error: node2: task 1" in proc.stderr or code == 0  # srun's own messages still reach the log
    (record,) = records
    assert record["event"] == "ended" and record["job"] == "4242" and record["attempt"] == 3
    assert record["code"] == code and record["ended"] >= record["began"] > 0
    if code == slurm_task.REQUEUE_EXIT_CODE:
        assert recorded[1:] == ["scontrol requeue 4242"]
        assert "job 4242 saved its state after a preemption signal: requeueing (restart 3)" in proc.stdout
        assert record["outcome"] == "preempted"
    elif code in (1, 137):
        assert recorded[1:] == ["scontrol requeue 4242", "scontrol update JobId=4242 ExcNodeList=node2"]
        cause = {1: "Exited with exit code 1", 137: "Killed"}[code]
        assert record == {**record, "outcome": "failed", "node": "node2", "process": "1", "cause": cause,
                          "action": "requeue", "says": "retry 1 of 3, excluding node2"}
        assert (f"job 4242 attempt 3 failed with exit code {code} (process 1 on node2: {cause}): retry 1 of 3, "
                "excluding node2") in proc.stdout
    else:
        assert recorded[1:] == []
        assert record["outcome"] == {0: "completed", 2: "configuration error"}[code]


def test_spares_ask_for_more_nodes_that_a_failed_node_does_not_take_down_and_the_run_uses_nodes_of_them() -> None:
    cfg = slurm.parse(["--nodes", "4", "--spares", "1", "--via", "sbatch"])
    assert (cfg.nodes, cfg.spares, cfg.allocated_nodes) == (4, 1, 5)
    argv = slurm.sbatch_argv(cfg)
    assert "--nodes=5" in argv and "--no-kill" in argv
    assert ",JOB_NODES=4," in next(a for a in argv if a.startswith("--export="))
    script = slurm.submitit_script(dataclasses.replace(cfg, via="submitit"), {})
    assert "#SBATCH --nodes=5" in script and "#SBATCH --no-kill" in script and "export JOB_NODES=4" in script
    plain = slurm.sbatch_argv(slurm.parse(["--nodes", "4", "--via", "sbatch"]))
    assert "--nodes=4" in plain and "--no-kill" not in plain  # without spares a lost node ends the job, as before


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_bad_spares_is_one_clear_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert slurm.main(["--spares", value, "--dry-run"], runner=RecordingRunner()) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: SPARES: expected") and "Fix: e.g. SPARES=4" in err, err


@pytest.mark.parametrize("route", ["sbatch", "submitit"])
def test_a_failure_restarts_in_the_allocation_on_a_spare_without_the_queue(route: str, tmp_path: Path) -> None:
    """SPARES=1: the job holds node1..3, a step uses 2; the process on node2 is killed, and the next step starts at
    once on node1 and node3 (no scontrol requeue), then completes."""
    proc, recorded, records = _run_batch(route, tmp_path, 0, spares=1, codes="137 0", restart=0)
    assert proc.returncode == 0, proc.stderr
    steps = [call for call in recorded if call.startswith("srun ")]
    assert len(steps) == 2 and recorded == steps  # no requeue, no probe: Slurm is asked nothing else
    assert steps[0].startswith("srun --nodes=2 --ntasks=2 --nodelist=node1,node2 ")
    assert steps[1].startswith("srun --nodes=2 --ntasks=2 --nodelist=node1,node3 ")
    assert "--kill-on-bad-exit=1" in steps[1]
    failed, done = records
    assert failed == {**failed, "attempt": 1, "code": 137, "outcome": "failed", "node": "node2", "process": "1",
                      "nodes": "node1,node2", "action": "restart",
                      "says": "restart 1 of 3 in the allocation, on a spare instead of node2"}
    assert done == {**done, "attempt": 2, "code": 0, "outcome": "completed", "nodes": "node1,node3"}
    assert ("job 4242 attempt 1 failed with exit code 137 (process 1 on node2: Killed): restart 1 of 3 in the "
            "allocation, on a spare instead of node2") in proc.stdout


@pytest.mark.parametrize("route", ["sbatch", "submitit"])
def test_with_no_spare_left_a_failure_is_requeued_and_where_requeue_is_disabled_restarts_on_a_node_that_answers(
        route: str, tmp_path: Path) -> None:
    # one spare, two failures: the first takes the spare, the second (node2 again: the stand-in's messages) has none
    proc, recorded, records = _run_batch(route, tmp_path, 0, spares=1, codes="1 1", restart=0)
    assert [r["says"] for r in records] == ["restart 1 of 3 in the allocation, on a spare instead of node2",
                                              "retry 2 of 3, excluding node2"]
    assert recorded[2:] == ["scontrol requeue 4242", "scontrol update JobId=4242 ExcNodeList=node2"]
    assert proc.returncode == 1
    # the same with requeue disabled: node2 answers a probe step, so the run restarts on the same nodes
    (tmp_path / "logs" / "4242-attempts.jsonl").unlink()
    proc, recorded, records = _run_batch(route, tmp_path, 0, codes="1 0 0", restart=0, requeue=0)
    assert proc.returncode == 0, proc.stderr
    assert recorded[1] == "srun --nodes=1 --ntasks=1 --nodelist=node2 true"  # the probe
    assert [r["says"] for r in records] == [
        "restart 1 of 3 in the allocation, on the same nodes (no spare left and the job cannot be requeued; node2 "
        "still answers)", "none"]
    # and a node that does not answer ends the run with the failure's code
    (tmp_path / "logs" / "4242-attempts.jsonl").unlink()
    proc, recorded, records = _run_batch(route, tmp_path, 0, codes="1 1", restart=0, requeue=0)
    assert proc.returncode == 1 and len(recorded) == 2
    assert records[-1]["says"] == ("not retried: no spare left, the job cannot be requeued, and node2 does not "
                                     "answer a probe step")


@pytest.mark.parametrize("route", ["sbatch", "submitit"])
def test_the_retry_budget_is_counted_across_requeues_and_preemptions_spend_none(route: str, tmp_path: Path) -> None:
    outcomes = []
    for restart, code in enumerate([1, 75, 137, 75, 1]):  # a budget of 2: the third failure ends the job
        proc, recorded, records = _run_batch(route, tmp_path, code, retries=2, restart=restart,
                                             excluded="node2" if restart else "")
        assert proc.returncode == code, proc.stderr
        outcomes.append((records[-1]["outcome"], records[-1]["says"], recorded[1:]))
    assert outcomes == [
        ("failed", "retry 1 of 2, excluding node2", ["scontrol requeue 4242", "scontrol update JobId=4242 ExcNodeList=node2"]),
        ("preempted", "requeued (a preemption spends no retry)", ["scontrol requeue 4242"]),
        ("failed", "retry 2 of 2, excluding node2", ["scontrol requeue 4242", "scontrol update JobId=4242 ExcNodeList=node2"]),
        ("preempted", "requeued (a preemption spends no retry)", ["scontrol requeue 4242"]),
        ("failed", "not retried: the retry budget is spent (2 of 2)", []),
    ]
    assert "job 4242 ends with exit code 1: not retried: the retry budget is spent (2 of 2)" in proc.stderr


@pytest.mark.parametrize("route", ["sbatch", "submitit"])
def test_a_failure_is_retried_without_excluding_its_node_when_too_few_nodes_would_be_left(
        route: str, tmp_path: Path) -> None:
    proc, recorded, _ = _run_batch(route, tmp_path, 1, excluded="node1,node3")
    assert recorded[1:] == ["scontrol requeue 4242"]  # node1, node2 and node3 out: one node left for two
    assert "requeued without excluding node2" in proc.stderr


@pytest.mark.parametrize(("first", "code", "outcome"), [
    ("Exited with exit code 2", 2, "configuration error"), ("Exited with exit code 1", 1, "failed"),
    ("Segmentation fault (core dumped)", 139, "failed"), ("Killed", 137, "failed")])
def test_the_jobs_code_is_the_first_failing_tasks_not_sruns_own(first: str, code: int, outcome: str,
                                                               tmp_path: Path) -> None:
    """srun ends with its last task's status: 143 once it stopped the others after the first failed. The job's is
    the first failing task's own: its exit code, or 128 + the signal that killed it (137 for the OOM killer's)."""
    proc, recorded, records = _run_batch("sbatch", tmp_path, 143, first=first)
    assert proc.returncode == code, proc.stderr
    assert records[-1]["code"] == code and records[-1]["outcome"] == outcome and records[-1]["cause"] == first
    assert (recorded[1:] == []) is (outcome != "failed")


def test_a_forks_batch_script_calling_the_old_step_still_requeues_and_retries(tmp_path: Path) -> None:
    """A batch script of its own that sources slurm/requeue.sh and calls requeue_if_preempted after srun
    (the step's name before retries), without watch_srun."""
    script = tmp_path / "fork.sbatch"
    script.write_text(f"#!/bin/bash\nsource {slurm.REQUEUE_SCRIPT}\nsrun python -m job train\n"
                      'requeue_if_preempted "$?"\n')
    (tmp_path / "submitit.sbatch").unlink(missing_ok=True)
    for code, expected in [(75, ["scontrol requeue 4242"]),
                           (1, ["scontrol requeue 4242", "scontrol update JobId=4242 ExcNodeList=node2"])]:
        _, _, _ = _run_batch("submitit", tmp_path, code)  # the stand-ins in tmp_path/bin
        env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"),
               "SRUN_CODE": str(code), "SLURM_JOB_ID": "4242", "JOB_LOG_DIR": str(tmp_path / "fork-logs"),
               "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_NUM_NODES": "2"}
        (tmp_path / "calls").unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == code, proc.stderr
        assert (tmp_path / "calls").read_text().splitlines()[1:] == expected
    records = [json.loads(line) for line in (tmp_path / "fork-logs" / "4242-attempts.jsonl").read_text().splitlines()]
    assert [r["outcome"] for r in records] == ["preempted", "failed"]


def test_retries_are_off_with_a_budget_of_zero(tmp_path: Path) -> None:
    proc, recorded, records = _run_batch("submitit", tmp_path, 137, retries=0)
    assert proc.returncode == 137 and recorded[1:] == []
    assert records[-1]["says"] == "not retried: retries are off (RETRIES=0)"


def test_no_batch_script_names_an_exit_code_the_policy_reads_them_from_one_table() -> None:
    for script in (slurm.REQUEUE_SCRIPT, slurm.SBATCH_SCRIPT):
        text = script.read_text()
        assert "EXIT_CODE" not in text and "scontrol" not in text, script  # the supervisor's, in Python
    assert slurm_task.REQUEUE_EXIT_CODE == exits.REQUEUE


# submitit's process_job installs its handlers before it runs the task: USR2 requeues the job from rank 0
# (scontrol requeue), SIGTERM is logged and ignored. A stand-in for them, then a signal before the loop's guard.
BEFORE_THE_GUARD = """
import os, signal, sys
import job.__main__
from deploy.slurm.task import JobTask
for sig in (signal.SIGUSR2, signal.SIGTERM):
    signal.signal(sig, lambda signum, frame: print("submitit's handler", flush=True))
def main(args):
    os.kill(os.getpid(), int(sys.argv[1]))
    return 0
job.__main__.main = main
JobTask()(["train"])
print("went on", flush=True)
"""


@pytest.mark.parametrize("sig", list(SIGNALS), ids=lambda s: s.name)
def test_the_submitit_task_drops_submitits_own_handlers_so_a_signal_acts_as_under_train_sbatch(sig: int) -> None:
    """SIGTERM ends the task by its default action; a notice (USR1, USR2) is remembered for the loop's guard
    (job.runtime.preemption.EarlyNotice), as `python -m job` does under slurm/train.sbatch."""
    proc = subprocess.run([sys.executable, "-c", BEFORE_THE_GUARD, str(int(sig))], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "submitit's handler" not in proc.stdout
    if sig == signal.SIGTERM:
        assert proc.returncode == -sig, (proc.returncode, proc.stdout, proc.stderr)  # as in sbatch
        assert "went on" not in proc.stdout
    else:
        assert proc.returncode == 0 and "went on" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
        assert f"received {signal.Signals(sig).name} during start-up: the run stops with 75" in proc.stderr


# ---------------------------------------------------------------------------------------------------- sweeps: one job array
def _half_done_sweep(folder: Path) -> sweeps.Todo:
    """A 4-run sweep whose runs 0 and 2 are pending (1 and 3 completed)."""
    from job.runs.sweep import plan

    sweep = plan("seed=0,1,2,3", ["train", "--steps", "40", "--run-dir", str(folder)])
    return sweeps.Todo(sweep, (0, 2))


@pytest.mark.parametrize(("indices", "parallel", "expected"), [
    ((0, 1, 2, 3), 2, "0-3%2"), ((1, 3), 2, "1,3%2"), ((0, 1, 2, 5, 6), None, "0-2,5-6"), ((4,), 1, "4%1")])
def test_the_array_spec_names_the_pending_runs_and_the_limit(indices: tuple, parallel: int | None,
                                                              expected: str) -> None:
    from deploy.slurm.array import array_spec

    assert array_spec(indices, parallel) == expected


def test_golden_sweep_array_sbatch_argv_and_srun_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.slurm import array

    monkeypatch.chdir(ROOT)
    cfg = dataclasses.replace(CPU, via="sbatch", log_dir="runs/slurm-logs", sweep="seed=0,1,2,3", sweep_parallel=2)
    todo = _half_done_sweep(Path("/shared/runs/sweep1"))
    argv = array.array_sbatch_argv(cfg, todo)
    assert argv[-3:] == [str(slurm.SBATCH_SCRIPT), "sweep-run", "/shared/runs/sweep1"]
    assert "--array=0,2%2" in argv and "--requeue" in argv
    text = "\n".join(argv) + f"\n\n{slurm.srun_line(array.element_config(cfg, todo), Runner(), ENVIRON)}\n"
    check_golden(GOLDEN / "sweep_array_sbatch_cpu.argv", normalized(text))


def test_golden_sweep_array_submitit_script(monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.slurm import array

    cfg = dataclasses.replace(CPU, sweep="seed=0,1,2,3", sweep_parallel=2)
    text = array.dry_run(cfg, _half_done_sweep(Path("/shared/runs/sweep1")), Runner())
    assert "#SBATCH --array=0-1%2" in text and "#SBATCH --requeue" in text and "/slurm/requeue.sh" in text
    check_golden(GOLDEN / "sweep_array_submitit_cpu.sbatch", normalized(text))


def test_a_sweep_checks_every_run_and_submits_nothing_on_a_bad_value(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=("sbatch",))
    argv = ["--nodes", "2", "--via", "sbatch", "--sweep", "optim.lr=1e-3,-1", "--log-dir", str(tmp_path / "logs"),
            "--", "train", "--run-dir", str(tmp_path / "sweep")]
    from deploy.slurm.array import main

    assert main(argv, runner) == 2
    err = capsys.readouterr().err
    assert "error: sweep run 'lr=-1': --optim.lr" in err and "nothing was submitted" in err
    assert not any(call[0] == "sbatch" for call in runner.calls)
    assert not (tmp_path / "sweep").exists()


def test_a_sweep_submits_one_array_of_the_pending_runs_and_nothing_when_all_completed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    folder = tmp_path / "sweep"
    done = folder / "seed=1"
    done.mkdir(parents=True)
    (done / "config.json").write_text(json.dumps({"steps": 4}))
    (done / "summary.json").write_text(json.dumps({"completed": True, "final_step": 4}))
    from deploy.slurm.array import main

    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (0, "77\n")})
    argv = ["--nodes", "2", "--via", "sbatch", "--sweep", "seed=0,1,2", "--sweep-parallel", "2",
            "--log-dir", str(tmp_path / "logs"), "--", "train", "--steps", "4", "--run-dir", str(folder)]
    assert main(argv, runner) == 0
    out = capsys.readouterr().out
    assert "1 of 3 already complete, skipped: seed=1; 2 to submit" in out
    assert "submitted Slurm job array 77: 2 run(s), 2 at once" in out and f"77_2: {folder}/seed=2" in out
    (sbatch,) = [call for call in runner.calls if call[0] == "sbatch"]
    assert "--array=0,2%2" in sbatch and sbatch[-2:] == ["sweep-run", str(folder)]
    assert [r["name"] for r in json.loads((folder / "sweep.json").read_text())["runs"]] == ["seed=0", "seed=1",
                                                                                            "seed=2"]
    for name in ("seed=0", "seed=2"):
        (folder / name).mkdir(exist_ok=True)
        (folder / name / "config.json").write_text(json.dumps({"steps": 4}))
        (folder / name / "summary.json").write_text(json.dumps({"completed": True, "final_step": 4}))
    runner.calls.clear()
    assert main(argv, runner) == 0
    assert "nothing new to submit: 3 of 3 complete" in capsys.readouterr().out
    assert not any(call[0] == "sbatch" for call in runner.calls)


def test_sweep_parallel_without_a_sweep_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=("sbatch",))
    assert slurm.main(["--nodes", "2", "--sweep-parallel", "2", "--dry-run"], runner) == 2
    assert "SWEEP_PARALLEL: expected SWEEP with it" in capsys.readouterr().err


def test_an_array_element_reads_its_run_from_the_saved_plan(tmp_path: Path) -> None:
    from job.runs.sweep import element_flags, plan, save_plan
    from tests.unit.test_cluster import CPU_4x1

    sweep = plan("seed=0,1", ["train", "--run-dir", str(tmp_path / "sweep")])
    save_plan(sweep)
    assert element_flags([str(tmp_path / "sweep")], {**CPU_4x1, "SLURM_ARRAY_TASK_ID": "1"}) == sweep.runs[1].flags
    assert element_flags([str(tmp_path / "sweep"), "0"], {}) == sweep.runs[0].flags
    with pytest.raises(ConfigError, match=r"array index \(slurm\): expected a run's index, 0..1, found 2"):
        element_flags([str(tmp_path / "sweep")], {**CPU_4x1, "SLURM_ARRAY_TASK_ID": "2"})
    with pytest.raises(ConfigError, match=r"array index \(slurm\): expected a run's index, 0..1, found 'none'"):
        element_flags([str(tmp_path / "sweep")], CPU_4x1)
    with pytest.raises(ConfigError, match="sweep.json"):
        element_flags([str(tmp_path / "nothing")], {**CPU_4x1, "SLURM_ARRAY_TASK_ID": "0"})
