"""`make doctor` on Slurm without a cluster: what scontrol and sinfo print, read right; each check's verdict; the
probe's srun argv and what its lines mean (deploy/slurm/partitions.py, deploy/slurm/doctor.py); the run's check
against the devices the request asks for; which doctor make picks, and why."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from deploy.slurm import doctor, partitions
from deploy.slurm import submit as slurm
from deploy.slurm.options import SlurmConfig
from deploy.slurm.partitions import PARTITION_ARGV, Node
from job.errors import ConfigError
from job.runtime.cluster.base import SKIP_GPU_CHECK
from tests.doubles import RecordingRunner
from tests.records import check_lines

# What `scontrol --all --oneliner show partition` printed on the local cluster (slurm/local-cluster.sh), plus a
# restricted GPU partition.
SCONTROL = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
    "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED "
    "MaxTime=7-00:00:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=node[1-4] PriorityJobFactor=1 "
    "PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=FORCE:4 OverTimeLimit=NONE PreemptMode=OFF State=UP "
    "TotalCPUs=32 TotalNodes=4 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED "
    "MaxMemPerNode=UNLIMITED TRES=cpu=32,mem=4M,node=4,billing=32\n"
    "PartitionName=island AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL Default=NO DefaultTime=NONE Hidden=YES "
    "MaxNodes=UNLIMITED MaxTime=7-00:00:00 MinNodes=0 Nodes=island State=UP TotalNodes=1\n"
    "PartitionName=gpu AllowGroups=ALL AllowAccounts=proj,ml AllowQos=normal,high Default=NO DefaultTime=01:00:00 "
    "Hidden=NO MaxNodes=2 MaxTime=2-00:00:00 MinNodes=1 Nodes=g[1-3] State=UP TotalNodes=3\n"
    "PartitionName=old AllowAccounts=ALL AllowQos=ALL Default=NO Hidden=NO MaxNodes=UNLIMITED MaxTime=INFINITE "
    "MinNodes=0 Nodes=o1 State=DRAIN\n"
)
DEBUG_NODES = "".join(f"node{i}|idle|8|1|gpu:4\n" for i in range(1, 5))
GPU_NODES = ("g1|mixed|64|512000|gpu:a100:8(S:0-1)\ng2|drained|64|512000|gpu:a100:8(S:0-1)\n"
             "g3|idle|32|256000|gpu:v100:4,gpu:a100:2\n")
NODE_QUERY = ("sinfo", "--noheader", "--Node", "--partition")


def cluster_runner(nodes: dict[str, str] | None = None, **more: tuple[int, str]) -> RecordingRunner:
    responses: dict[tuple[str, ...], tuple[int, str]] = {PARTITION_ARGV: (0, SCONTROL)}
    for name, text in (nodes or {"debug": DEBUG_NODES, "gpu": GPU_NODES, "island": "island|idle|8|1|gpu:4\n",
                                 "old": "o1|drained|8|1|(null)\n"}).items():
        responses[(*NODE_QUERY, name)] = (0, text)
    responses.update((tuple(k.split()), v) for k, v in more.items())
    return RecordingRunner(available=("sbatch",), responses=responses)


# ---------------------------------------------------------------------------------------------------- Slurm's words
@pytest.mark.parametrize(("text", "minutes"), [
    ("30", 30), ("30:15", 31), ("01:00:00", 60), ("1:30:01", 91), ("2-12", 3600), ("2-12:30", 3630),
    ("2-12:30:30", 3631), ("7-00:00:00", 10080), ("UNLIMITED", None), ("INFINITE", None), ("infinite", None),
    ("NONE", None), ("0", 0),
])
def test_every_slurm_time_format_reads_as_minutes_rounded_up(text: str, minutes: int | None) -> None:
    assert partitions.limit_minutes(text) == minutes


@pytest.mark.parametrize("text", ["1h", "", "1-", "-1", "1:2:3:4", "2 days"])
def test_a_time_limit_slurm_would_not_print_is_an_error(text: str) -> None:
    with pytest.raises(ValueError, match="not a Slurm time limit"):
        partitions.limit_minutes(text)


def test_scontrol_one_line_values_keep_their_spaces_and_inner_equals() -> None:
    kv = partitions.key_values("NodeName=n1 OS=Linux 6.1.0 #1 SMP CfgTRES=cpu=8,mem=1M State=DOWN+DRAIN "
                               "Reason=Not responding [slurm@2026-12-03T10:00:00] Comment=(null)")
    assert kv["OS"] == "Linux 6.1.0 #1 SMP" and kv["CfgTRES"] == "cpu=8,mem=1M"
    assert kv["Reason"] == "Not responding [slurm@2026-12-03T10:00:00]" and kv["Comment"] == "(null)"


def test_partitions_read_with_their_state_limits_and_who_may_use_them() -> None:
    debug, island, gpu, old = partitions.parse_partitions(SCONTROL)
    assert debug == partitions.Partition("debug", "UP", True, False, "7-00:00:00", "NONE", None, 0, None, None)
    assert island.hidden and not island.default
    assert (gpu.max_nodes, gpu.min_nodes) == (2, 1)
    assert (gpu.allow_accounts, gpu.allow_qos) == (("proj", "ml"), ("normal", "high"))
    assert gpu.default_time == "01:00:00" and partitions.limit_minutes(gpu.max_time) == 2880
    assert old.state == "DRAIN" and partitions.limit_minutes(old.max_time) is None
    assert partitions.parse_partitions("No partitions in the system\n") == ()


@pytest.mark.parametrize(("gres", "gpus"), [
    ("gpu:4", ((None, 4),)), ("gpu:a100:8(S:0-1)", (("a100", 8),)),
    ("gpu:v100:4,gpu:a100:2", (("v100", 4), ("a100", 2))), ("gpu:a100:4(S:0,1),mps:400", (("a100", 4),)),
    ("(null)", ()), ("mps:100", ()), ("gpu:h100:8(IDX:0-7)", (("h100", 8),)),
])
def test_sinfo_gres_gives_each_gpu_type_and_count(gres: str, gpus: tuple[tuple[str | None, int], ...]) -> None:
    assert partitions.parse_gres(gres) == gpus


@pytest.mark.parametrize(("state", "available"), [
    ("idle", True), ("mixed", True), ("allocated", True), ("completing", True), ("idle~", True), ("mixed-", True),
    ("down*", False), ("down", False), ("drained", False), ("draining", False), ("idle*", False), ("fail", False),
    ("inval", False), ("future", False), ("drained*", False),
])
def test_a_node_takes_jobs_unless_down_drained_failed_or_not_responding(state: str, available: bool) -> None:
    assert Node("n", state, 8, 1, ()).available is available


@pytest.mark.parametrize(("state", "answers"), [
    ("idle", True), ("mixed", True), ("allocated", True), ("drained", True), ("draining", True), ("idle~", True),
    ("idle*", False), ("allocated*", False), ("down*", False), ("down", False), ("unknown", False),
    ("unknown*", False), ("down+drain", False),
])
def test_a_node_answers_unless_down_unknown_or_not_responding(state: str, answers: bool) -> None:
    assert Node("n", state, 8, 1, ()).answers is answers


def test_sinfo_nodes_read_with_cpus_memory_and_gpus() -> None:
    g1, g2, g3 = partitions.parse_nodes(GPU_NODES + "garbage line\n")
    assert g1 == Node("g1", "mixed", 64, 512000, (("a100", 8),))
    assert not g2.available and g3.gpu_count("a100") == 2 and g3.gpu_count(None) == 6


@pytest.mark.parametrize(("mem", "mb"), [("64G", 65536), ("500M", 500), ("500", 500), ("1T", 1048576),
                                         ("1536K", 2), ("0", 0), ("2g", 2048)])
def test_mem_reads_as_slurm_reads_it(mem: str, mb: int) -> None:
    assert partitions.mem_mb(mem) == mb


# ---------------------------------------------------------------------------------------------------- quick checks
def quick(runner: RecordingRunner, **cfg: object) -> list[doctor.Check]:
    return list(doctor.quick_checks(SlurmConfig(**cfg), runner, {}))  # type: ignore[arg-type]


def failures(checks: Sequence[doctor.Check]) -> list[str]:
    return [check.line() for check in checks if not check.ok]


def test_the_quick_checks_read_the_partition_and_its_nodes_with_two_commands() -> None:
    runner = cluster_runner()
    checks = quick(runner, nodes=4)
    assert failures(checks) == []
    assert [c.name for c in checks] == [*(name for name, _ in partitions.QUICK), "nodes answer"]
    assert checks[-1].line() == "ok    nodes answer: all 4 node(s) of partition debug answer the controller"
    assert runner.calls == [list(PARTITION_ARGV),
                            ["sinfo", "--noheader", "--Node", "--partition", "debug", "--format", "%N|%T|%c|%m|%G"]]


@pytest.mark.parametrize(("cfg", "line"), [
    ({"partition": "nosuch"}, "FAIL  partition: PARTITION: expected one of debug, gpu, old, found 'nosuch'. Fix: "
                              "pick a listed partition (sinfo shows them) or leave PARTITION unset"),
    ({"time": "99-00:00:00"}, "FAIL  time limit: TIME: expected at most partition debug's MaxTime 7-00:00:00, found "
                              "'99-00:00:00'. Fix: TIME=7-00:00:00 or less (the job saves and requeues itself at its "
                              "limit)"),
    ({"partition": "gpu", "nodes": 2, "time": "3-00:00:00", "account": "proj"},
     "FAIL  time limit: TIME: expected at most partition gpu's MaxTime 2-00:00:00, found '3-00:00:00'. Fix: "
     "TIME=2-00:00:00 or less (the job saves and requeues itself at its limit), or PARTITION=debug (MaxTime long "
     "enough: debug)"),
    ({"nodes": 5}, "FAIL  nodes: NODES: expected at most 4: partition debug has 4 node(s), found 5. Fix: NODES=4, "
                   "or another PARTITION (gpu)"),
    ({"nodes": 3, "spares": 2}, "FAIL  nodes: NODES+SPARES: expected at most 4: partition debug has 4 node(s), found 5. "
                                "Fix: NODES=2, or another PARTITION (gpu)"),
    ({"gpus_per_node": 8}, "FAIL  GPUs per node: GPUS_PER_NODE: expected at most 4: the most GPUs a node of "
                           "partition debug has, found '8'. Fix: GPUS_PER_NODE=4"),
    ({"partition": "gpu", "nodes": 2, "gpus_per_node": 4, "gpu_type": "h100"},
     "FAIL  GPUs per node: GPUS_PER_NODE: expected at most 0: the most h100 GPUs a node of partition gpu has (GPU "
     "types there: a100, v100), found '4 h100'. Fix: a PARTITION with GPU nodes (sinfo -o '%P %G')"),
    ({"partition": "gpu", "nodes": 3}, "FAIL  nodes: NODES: expected at most partition gpu's MaxNodes 2, found 3. "
                                       "Fix: NODES=2, or a PARTITION with a larger MaxNodes"),
    ({"partition": "gpu", "nodes": 2, "gpus_per_node": 8},  # g2 has 8 too, but is drained; g3 has 6
     "FAIL  nodes: NODES: expected at most 1: the such nodes of partition gpu that take jobs (the job would wait in "
     "the queue until the others come back), found 2. Fix: NODES=1, another PARTITION (debug), or wait until the "
     "admins resume g2 (drained)"),
    ({"partition": "gpu", "nodes": 1, "gpus_per_node": 8, "tasks_per_node": 8, "cpus_per_task": 16},
     "FAIL  CPUs per node: CPUS_PER_TASK: expected TASKS_PER_NODE x CPUS_PER_TASK at most 64, the most CPUs a node of "
     "partition gpu has, found '8 x 16 = 128'. Fix: CPUS_PER_TASK=8 or less"),
    ({"partition": "gpu", "nodes": 1, "mem": "1T"},
     "FAIL  memory per node: MEM: expected at most 512000M, the most memory (RealMemory) a node of partition gpu has, "
     "found '1T'. Fix: MEM=512000M or less, or MEM=0 (all)"),
    ({"partition": "gpu", "nodes": 1, "account": "other"},
     "FAIL  access: ACCOUNT: expected one of partition gpu's AllowAccounts (proj, ml), found 'other'. Fix: "
     "ACCOUNT=proj, or a PARTITION that allows other"),
    ({"partition": "gpu", "nodes": 1, "qos": "low"},
     "FAIL  access: QOS: expected one of partition gpu's AllowQos (normal, high), found 'low'. Fix: QOS=normal, or "
     "a PARTITION that allows low"),
])
def test_each_quick_check_fails_with_the_value_what_was_expected_and_the_fix(cfg: dict[str, object], line: str) -> None:
    assert failures(quick(cluster_runner(), **cfg)) == [line]


def test_a_node_whose_slurmd_died_is_named_with_the_fix_though_the_job_fits_on_the_others() -> None:
    debug = DEBUG_NODES.replace("node3|idle", "node3|idle*").replace("node4|idle", "node4|down*")
    checks = quick(cluster_runner({"debug": debug}), nodes=2)
    assert failures(checks) == [
        "FAIL  nodes answer: expected every node of partition debug to answer the controller (its slurmd running), "
        "found 2 of 4 that do not: node3 (idle*: not responding), node4 (down*: not responding). Fix: start slurmd "
        "on node3 again (the local cluster: `make slurm-up NODES=...` with its node count starts any that died; "
        "elsewhere: ask the admins), then, if it stays down, `scontrol update nodename=node3,node4 state=resume`"]
    assert {c.name: c.detail for c in checks}["nodes"] == "2 asked, partition debug has 2 node(s) taking jobs"


def test_many_silent_nodes_are_counted_after_the_first_ten() -> None:
    nodes = "".join(f"n{i}|unknown|8|1|(null)\n" for i in range(12))
    runner = cluster_runner({"debug": nodes})
    (line,) = [c.line() for c in quick(runner, nodes=1) if c.name == "nodes answer"]
    assert "found 12 of 12 that do not: n0 (unknown), " in line and "n9 (unknown) and 2 more. Fix:" in line
    assert "nodename=n0,n1,n2,n3,n4,n5,n6,n7,n8,n9,n10,n11 state=resume" in line


def test_a_drained_partition_says_so_and_that_its_nodes_take_no_job() -> None:
    assert failures(quick(cluster_runner(), partition="old", nodes=1)) == [
        "FAIL  partition: PARTITION: expected a partition in state UP (DOWN queues jobs that never start, DRAIN and "
        "INACTIVE refuse them), found 'old, which is DRAIN'. Fix: PARTITION=debug (debug, gpu UP), or ask the admins "
        "when old comes back",
        "FAIL  nodes: NODES: expected at most 0: the nodes of partition old that take jobs (the job would wait in the "
        "queue until the others come back), found 1. Fix: another PARTITION (debug, gpu), or wait until the admins "
        "resume o1 (drained)"]


def test_a_partition_within_every_limit_passes_with_what_it_found() -> None:
    checks = quick(cluster_runner(), partition="gpu", nodes=1, gpus_per_node=8, gpu_type="a100", time="2-00:00:00",
                   account="ml", qos="high", mem="0", cpus_per_task=8)
    assert failures(checks) == []
    assert "gpu is UP, 3 node(s)" in checks[0].line()
    found = {check.name: check.detail for check in checks}
    assert found["time limit"] == "TIME=2-00:00:00 within gpu's MaxTime 2-00:00:00, DefaultTime 01:00:00"
    assert found["nodes"] == "1 asked, partition gpu has 1 such node(s) taking jobs"  # g1; g2 is drained, g3 small


def test_no_default_partition_asks_for_one() -> None:
    runner = cluster_runner()
    runner.responses[PARTITION_ARGV] = (0, SCONTROL.replace("Default=YES", "Default=NO"))
    assert failures(quick(runner)) == ["FAIL  partition: PARTITION: expected a partition: this cluster has no default "
                                       "one, found 'PARTITION unset'. Fix: PARTITION=... (one of debug, gpu, old)"]


def test_no_sbatch_is_the_one_line_and_nothing_runs() -> None:
    runner = RecordingRunner(available=())
    (check,) = quick(runner)
    assert not check.ok and "make slurm-up NODES=4" in check.line() and runner.calls == []


def test_a_slurm_controller_that_does_not_answer_is_one_line_with_the_fix() -> None:
    said = "scontrol: error: Unable to contact slurm controller (connect failure)"
    assert failures(quick(RecordingRunner(available=("sbatch",), responses={("scontrol",): (1, said)}))) == [
        f"FAIL  partition: Slurm: expected a Slurm controller that scontrol can reach, found '{said}'. Fix: run this "
        "on the cluster's login node, or start the local cluster: `make slurm-up NODES=4`"]


def test_submit_refuses_a_quick_check_failure_before_sbatch(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    runner = cluster_runner(sbatch=(0, "7\n"))
    assert slurm.main(["--via=sbatch", f"--log-dir={tmp_path}/logs", "--time=8-00:00:00"], runner=runner) == 2
    err = capsys.readouterr().err
    assert err == ("error: TIME: expected at most partition debug's MaxTime 7-00:00:00, found '8-00:00:00'. Fix: "
                   "TIME=7-00:00:00 or less (the job saves and requeues itself at its limit)\n")
    assert [call[0] for call in runner.calls] == ["scontrol", "sinfo"] and not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------------------------------- the probe
@pytest.mark.parametrize(("args", "run_dir"), [
    (("train", "--run-dir", "runs/a"), "runs/a"), (("train",), "runs/example"),
    (("train", "--run-dir=x", "--run_dir", "y"), "y"), (("sweep-run", "runs/sweep1"), "runs/sweep1"),
    (("train", "--run-dir", "gs://b/r"), "gs://b/r"),
])
def test_the_run_dir_is_found_as_train_sbatch_finds_it(args: tuple[str, ...], run_dir: str) -> None:
    assert doctor.run_dir_of(args) == run_dir


def test_the_default_run_dir_is_the_trainings_own() -> None:
    from job.train.config import TrainConfig

    assert doctor.DEFAULT_RUN_DIR == TrainConfig.run_dir


def test_the_probe_is_one_short_task_with_the_jobs_partition_account_qos_and_constraint() -> None:
    cfg = SlurmConfig(nodes=4, partition="gpu", account="proj", qos="high", constraint="a100", gpus_per_node=8,
                      time="00:03:00", mem="64G", python="/shared/venv/bin/python")
    argv = doctor.probe_argv(cfg, Path("/shared/run"), "abc", "", 30)
    assert argv[:argv.index("bash")] == [
        "srun", "--job-name=jax-job-doctor", "--nodes=1", "--ntasks=1", "--time=3", "--immediate=30", "--quiet",
        "--partition=gpu", "--account=proj", "--qos=high", "--constraint=a100"]  # no GPUs, memory or exclusivity
    assert argv[argv.index("bash"):] == ["bash", "-c", doctor.PROBE_SCRIPT.read_text(), "doctor-probe", "/shared/run",
                                         "abc", "/shared/venv/bin/python", "", ""]
    long = doctor.probe_argv(dataclasses.replace(cfg, time="2-00:00:00", image="img"), None, "t", "podman", 60)
    assert "--time=5" in long and long[-5:] == ["", "t", "", "img", "podman"]


def test_the_probes_lines_are_read_and_others_ignored() -> None:
    out = "doctor:node=node1\nnoise=1\ndoctor:python=ok 3.11.7 0.10.2 0 /x/job/__init__.py\ndoctor:bad\n"
    assert doctor.findings(out) == {"node": "node1", "python": "ok 3.11.7 0.10.2 0 /x/job/__init__.py"}


class ComputeNode(RecordingRunner):
    """Answers the probe's srun as a compute node would: runs the probe script here (this machine is the node,
    with no program on PATH), `see_run_dir` false standing for a node that has its own folder of that name."""

    see_run_dir: bool = True

    def run(self, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:  # type: ignore[override]
        if argv[0] != "srun" or "--help" in argv:
            return super().run(argv, **kwargs)
        self.calls.append(list(argv))
        command = list(argv[argv.index("bash"):])
        if not self.see_run_dir:
            command[4] = command[4] + "-elsewhere"
            os.makedirs(command[4], exist_ok=True)
        command[0] = shutil.which("bash") or "/bin/bash"  # the node's PATH has no program: no apptainer, no podman
        proc = subprocess.run(command, capture_output=True, text=True, env={"SLURMD_NODENAME": "node7",
                                                                            "PATH": "/nonexistent"})
        return subprocess.CompletedProcess(argv, proc.returncode, proc.stdout, proc.stderr)


def doctor_lines(runner: RecordingRunner, tmp_path: Path, *flags: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    code = doctor.main(["--nodes=1", *flags, "--", "train", "--run-dir", str(tmp_path / "run")], runner=runner,
                       environ={})
    out = capsys.readouterr().out.splitlines()
    assert code == (1 if any(line.startswith("FAIL") for line in out) else 0), out
    return out


def fake_python(tmp_path: Path) -> str:
    """An interpreter that answers the probe's `-c IMPORT` as one with the job, jax 0.10.2 and no CUDA plugin does."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 3.11.7 0.10.2 0 /shared/job/__init__.py\n")
    python.chmod(0o755)
    return str(python)


def test_a_probe_that_reads_its_token_back_passes_and_leaves_nothing(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    runner = ComputeNode(available=("sbatch",), responses=cluster_runner().responses)
    out = doctor_lines(runner, tmp_path, "--python", fake_python(tmp_path), capsys=capsys)
    assert out[-1] == (f"ok    interpreter on a compute node: {tmp_path / 'python'} on node7: Python 3.11.7, "
                       "jax 0.10.2, job from /shared/job/__init__.py")
    assert [line.split(":")[0] for line in out[-4:]] == ["ok    probe job", "ok    submit folder on a compute node",
                                                          "ok    run dir on a compute node",
                                                          "ok    interpreter on a compute node"]
    assert f"{tmp_path / 'run'} is the same folder on node7" in out[-2]
    assert not (tmp_path / "run").exists()  # made for the probe (the job makes it again), then removed


def test_a_token_the_login_node_does_not_see_is_a_folder_of_the_same_name_elsewhere(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runner = ComputeNode(available=("sbatch",), responses=cluster_runner().responses)
    runner.see_run_dir = False
    out = doctor_lines(runner, tmp_path, "--quick=0", "--python", fake_python(tmp_path), capsys=capsys)
    assert (f"FAIL  run dir on a compute node: --run-dir {tmp_path / 'run'}: a token written there on node7 is not "
            "here: node7 has its own folder of that name (like /tmp on each machine)") in out[-3]


def test_gpus_need_the_cuda_plugin_on_the_compute_node_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runner = ComputeNode(available=("sbatch",), responses=cluster_runner().responses)
    out = doctor_lines(runner, tmp_path, "--gpus-per-node=4", "--python", fake_python(tmp_path), capsys=capsys)
    assert out[-2] == (f"FAIL  interpreter on a compute node: PYTHON={tmp_path / 'python'} on node7 has no jax CUDA "
                       "plugin (jax-cuda12-plugin) for GPUS_PER_NODE=4: jax would train on the CPU. Fix: `make venv "
                       "FLAVOR=cuda` and leave PYTHON unset, or IMAGE=...:cuda; stand-in GPUs: JOB_SKIP_GPU_CHECK=1")


@pytest.mark.parametrize(("runtime", "srun_help", "line"), [
    ("auto", "--container  Path to OCI container bundle", "FAIL  container runtime: IMAGE=docker://x/job:cpu runs "
     "through apptainer (CONTAINER_RUNTIME=auto and srun has no pyxis), which is not on PATH on node7. Fix: "
     "CONTAINER_RUNTIME=podman (or apptainer) where it is installed, `module load apptainer` in the shell that runs "
     "make, or unset IMAGE to run from the shared venv"),
    ("auto", "--container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH", "ok    container runtime: pyxis (srun "
     "--container-image) on this node's srun"),
    ("pyxis", "", "FAIL  container runtime: CONTAINER_RUNTIME: expected pyxis: srun with --container-image, found "
     "'pyxis, but `srun --help` has no --container-image'. Fix: CONTAINER_RUNTIME=auto (apptainer), or "
     "CONTAINER_RUNTIME=podman where podman is installed"),
])
def test_an_image_needs_the_runtime_train_sbatch_would_pick(runtime: str, srun_help: str, line: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    runner = ComputeNode(available=("sbatch",), responses={**cluster_runner().responses,
                                                           ("srun", "--help"): (0, srun_help)})
    out = doctor_lines(runner, tmp_path, "--image=docker://x/job:cpu", f"--container-runtime={runtime}",
                       capsys=capsys)
    assert line in out, out


def test_an_srun_that_cannot_start_is_one_line_and_the_quick_checks_still_print(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    said = "srun: error: Unable to allocate resources: Requested partition configuration not available now"
    runner = cluster_runner(srun=(1, ""))
    runner.responses[("srun",)] = (1, said)
    out = doctor_lines(runner, tmp_path, "--probe-wait", "5", capsys=capsys)
    assert out[-2] == (f"FAIL  probe job: srun of one task did not run (exit 1): {said}. Fix: see srun's words "
                       "above; the quick checks said what they could")
    assert sum(line.startswith("ok") for line in out) == len(partitions.QUICK) + 2  # nodes answer, the run


def test_quick_runs_no_probe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runner = cluster_runner()
    doctor_lines(runner, tmp_path, "--quick", capsys=capsys)
    assert [call[0] for call in runner.calls] == ["scontrol", "sinfo"]


@pytest.mark.parametrize("wait", ["0", "x", "-1"])
def test_a_bad_probe_wait_is_one_line(wait: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main([f"--probe-wait={wait}"], runner=cluster_runner()) == 1
    assert capsys.readouterr().out.startswith(f"FAIL  request: PROBE_WAIT: expected whole seconds 1..86400, found "
                                              f"'{wait}'")


def test_a_bad_request_value_is_the_one_line_and_nothing_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runner = cluster_runner()
    assert doctor.main(["--time=1h"], runner=runner) == 1
    assert capsys.readouterr().out.startswith("FAIL  request: TIME: expected MM, MM:SS, HH:MM:SS")
    assert runner.calls == []


def test_checks_raise_config_error_for_submit() -> None:
    with pytest.raises(ConfigError, match="NODES: expected at most 4"):
        partitions.require(SlurmConfig(nodes=9), cluster_runner())


def test_a_gs_run_dir_is_not_probed_as_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runner = ComputeNode(available=("sbatch",), responses=cluster_runner().responses)
    code = doctor.main(["--nodes=1", "--python", fake_python(tmp_path), "--", "train", "--run-dir",
                        "gs://my-bucket/run1"], runner=runner, environ={})
    out = capsys.readouterr().out
    assert code == 0, out  # a valid bucket name: the run's check refuses one under 3 characters
    assert ("skip  run dir on a compute node: gs://my-bucket/run1 is object storage, not a folder: not probed. To "
            "run it: `python -m job check-run-dir gs://my-bucket/run1` checks that a host can write there") in out
    (srun,) = [call for call in runner.calls if call[0] == "srun"]
    assert srun[-5] == ""  # no folder for the probe to write its token into


def test_a_dry_run_without_a_controller_is_still_printed(capsys: pytest.CaptureFixture[str]) -> None:
    said = "scontrol: error: Unable to contact slurm controller (connect failure)"
    runner = RecordingRunner(available=("sbatch",), responses={("scontrol",): (1, said)})
    assert slurm.main(["--nodes=2", "--dry-run", "--log-dir=/logs"], runner=runner) == 0
    assert "#SBATCH --nodes=2" in capsys.readouterr().out
    assert slurm.main(["--nodes=2", "--log-dir=/logs"], runner=runner) == 2  # not a dry run: the one error
    assert "a Slurm controller that scontrol can reach" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- make doctor
def make_doctor_recorded(tmp_path: Path, *variables: str, sbatch: bool = False) -> tuple[str, list[str]]:
    """`make doctor VARIABLES` with a `python` that records its argv instead of running, and on PATH nothing but
    (with `sbatch`) a stand-in sbatch: the line make printed first, and what it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text("#!/bin/sh\nprintf '%s\\n' \"$@\" >\"$RECORD\"\n")
    (bin_dir / "python").chmod(0o755)
    on_path = tmp_path / "path"
    on_path.mkdir(exist_ok=True)
    if sbatch:
        (on_path / "sbatch").write_text("#!/bin/sh\nexit 0\n")
        (on_path / "sbatch").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHON", "ARGS", "SWEEP", "TPU_NAME", "WHERE")}
    proc = subprocess.run([shutil.which("make") or "make", "--no-print-directory", "-o", f"{bin_dir}/.installed",
                           f"BIN={bin_dir}", f"SLURM_ENV={tmp_path}/no-env.sh", "doctor", *variables], cwd=doctor.ROOT,
                          env={**env, "RECORD": str(tmp_path / "argv"), "PATH": str(on_path)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[0], (tmp_path / "argv").read_text().splitlines()


def make_doctor_argv(tmp_path: Path, *variables: str) -> list[str]:
    """What `make doctor VARIABLES` ran (`make_doctor_recorded`)."""
    return make_doctor_recorded(tmp_path, *variables)[1]


def test_make_doctor_goes_where_it_is_told(tmp_path: Path) -> None:
    slurm_argv = make_doctor_argv(tmp_path, "WHERE=slurm", "NODES=3", "TIME=2-00", "QUICK=1", "ARGS=train --steps 5")
    assert slurm_argv[:2] == ["-m", "deploy.slurm.doctor"]
    assert {"--nodes", "3", "--time", "2-00", "--quick=1", "--args=train --steps 5", "--check-run=1"} <= set(slurm_argv)
    bin_dir = tmp_path / "bin"
    assert make_doctor_argv(tmp_path, "WHERE=local", "NPROC=2", "DEVICES=3") == [
        "-m", "deploy.local.doctor", "-n", "2", "--devices-per-process", "3", "--python", f"{bin_dir}/python",
        "--args=train --run-dir runs/local", "--sweep=", "--check-run=0"]
    tpu = make_doctor_argv(tmp_path, "TPU_NAME=pod1", "ZONE=us-central2-b")  # TPU_NAME: tpu unless WHERE says otherwise
    assert tpu[:3] == ["-m", "deploy.tpu", "doctor"] and "--name=pod1" in tpu and tpu[-1] == "--check-run=0"


@pytest.mark.parametrize(("variables", "sbatch", "first"), [
    (("WHERE=local", "TPU_NAME=pod1"), True, "make doctor: WHERE=local (given)"),
    (("TPU_NAME=pod1", "ZONE=us-central2-b"), True,
     "make doctor: WHERE=tpu (TPU_NAME is set; WHERE=slurm or WHERE=local to choose)"),
    (("NODES=2",), True, "make doctor: WHERE=slurm (sbatch is on PATH; WHERE=local or WHERE=tpu to choose)"),
    ((), False, "make doctor: WHERE=local (no TPU_NAME, no sbatch on PATH; WHERE=slurm or WHERE=tpu to choose)"),
])
def test_make_doctors_first_line_names_the_target_and_why(variables: tuple[str, ...], sbatch: bool, first: str,
                                                         tmp_path: Path) -> None:
    assert make_doctor_recorded(tmp_path, *variables, sbatch=sbatch)[0] == first


@pytest.mark.parametrize(("variables", "check_run"), [
    (("ARGS=train --steps 5",), "--check-run=1"), (("SWEEP=seed=0,1",), "--check-run=1"), ((), "--check-run=0"),
])
def test_make_doctor_checks_the_run_when_given_args_or_a_sweep(variables: tuple[str, ...], check_run: str,
                                                              tmp_path: Path) -> None:
    for where in ("WHERE=slurm", "WHERE=local", "WHERE=tpu"):
        assert make_doctor_argv(tmp_path, where, "TPU_NAME=pod1", *variables)[-1] == check_run, where


# ---------------------------------------------------------------------------------------------------- the run
def slurm_run_line(*flags: str, args: str, environ: dict[str, str] | None = None,
                   capsys: pytest.CaptureFixture[str]) -> str:
    """The run's line of the Slurm doctor's quick checks against the stand-in cluster, ARGS `args`."""
    code = doctor.main(["--quick", *flags, "--", *args.split()], runner=cluster_runner(), environ=environ or {})
    line = check_lines(capsys.readouterr().out)["run"]
    assert code == (1 if line.startswith("FAIL") else 0), line
    return line


def test_a_task_that_does_not_import_is_the_runs_fail_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert slurm_run_line("--nodes=2", args="train --task nosuch.mod:TASK --data.global-batch 30", capsys=capsys) == (
        "FAIL  run: --task: expected an importable module nosuch.mod, found \"nosuch.mod:TASK (No module named "
        "'nosuch')\". Fix: pass --task PACKAGE.MODULE:ATTR with the module importable (installed, or on PYTHONPATH)")


@pytest.mark.parametrize(("flags", "environ", "devices"), [
    (("--nodes=2", "--gpus-per-node=4"), {SKIP_GPU_CHECK: "1"}, "8 devices (NODES=2 x GPUS_PER_NODE=4)"),
    (("--nodes=2", "--gpus-per-node=4", "--tasks-per-node=4"), {SKIP_GPU_CHECK: "1"},
     "8 devices (NODES=2 x GPUS_PER_NODE=4)"),
    (("--nodes=2", "--tasks-per-node=2"), {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
     "8 devices (NODES=2 x TASKS_PER_NODE=2 x 2 CPU devices from XLA_FLAGS)"),
    (("--nodes=3",), {}, "3 devices (NODES=3 x TASKS_PER_NODE=1, one CPU device each)"),
])
def test_the_batch_is_checked_against_the_devices_the_request_asks_for(
        flags: tuple[str, ...], environ: dict[str, str], devices: str, capsys: pytest.CaptureFixture[str]) -> None:
    count = int(devices.split()[0])
    batch = 32 if 32 % count else 30  # one that does not split over them
    line = slurm_run_line(*flags, args=f"train --data.global-batch {batch}", environ=environ, capsys=capsys)
    fits = count * -(-batch // count)
    assert line == (f"FAIL  run: --data.global-batch: expected a multiple of the data-parallel size {count} = {count}, "
                    f"found {batch} on {devices}. Fix: use --data.global-batch {fits}")
    line = slurm_run_line(*flags, args=f"train --data.global-batch {fits}", environ=environ, capsys=capsys)
    assert line == f"ok    run: task lm: global batch {fits} splits over {devices}"


def test_every_run_of_a_sweep_is_checked_on_the_jobs_devices(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    line = slurm_run_line("--nodes=4", "--sweep=seed=0,1 data.global-batch=32,30",
                          args=f"train --run-dir {tmp_path / 'sweep'}", capsys=capsys)
    assert line.startswith("FAIL  run: sweep run 'seed=0,global-batch=30': --data.global-batch: expected a multiple "
                           "of the data-parallel size 4 = 4, found 30 on 4 devices (NODES=4 x TASKS_PER_NODE=1, one "
                           "CPU device each). Fix: use --data.global-batch 32. 1 other run(s) fail too: "
                           "seed=1,global-batch=30"), line


def test_check_run_0_says_the_run_was_not_checked(capsys: pytest.CaptureFixture[str]) -> None:
    line = slurm_run_line("--nodes=2", "--check-run=0", args="train --task nosuch.mod:TASK", capsys=capsys)
    assert line == ("skip  run: no ARGS given. To run it: ARGS='train ...' (its task, config and global batch on "
                    "2 devices (NODES=2 x TASKS_PER_NODE=1, one CPU device each) are checked)")


def test_the_run_is_checked_even_where_the_cluster_cannot_be_read(capsys: pytest.CaptureFixture[str]) -> None:
    code = doctor.main(["--nodes=4", "--", "train", "--data.global-batch", "30"], runner=RecordingRunner(), environ={})
    found = check_lines(capsys.readouterr().out)
    assert code == 1 and list(found) == ["sbatch", "run"], found
    assert found["run"].startswith("FAIL  run: --data.global-batch: expected a multiple of the data-parallel size 4")


def test_make_doctor_refuses_an_unknown_where(tmp_path: Path) -> None:
    proc = subprocess.run(["make", "--no-print-directory", "-o", f"{tmp_path}/.installed", f"BIN={tmp_path}",
                           "doctor", "WHERE=mars"], cwd=doctor.ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "make doctor: expected WHERE=local, slurm or tpu, found WHERE=mars. Fix: WHERE=slurm" in proc.stderr
