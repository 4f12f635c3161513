"""Cluster detection and `job.initialize` resolution, from recorded environment tables.

Every table is a plain dict of the variables the real launcher sets (srun, our
`job.launch`, the GKE TPU runtime); nothing here reads os.environ or talks to a
network. The two `initialize` tests run in a subprocess because JAX's backend
state is per process.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from job.errors import ConfigError
from job.runtime.cluster import (
    DETECTION_ORDER,
    KINDS,
    PER_PROCESS,
    SINGLE,
    ClusterInfo,
    detect,
    environment,
    node_name,
)
from job.runtime.cluster.base import read_id_list, read_int, read_port, visible_gpus
from job.runtime.cluster.local import LocalLauncher
from job.runtime.cluster.nodelist import first_node
from job.runtime.cluster.slurm import SlurmJob, slurm_port
from job.runtime.cluster.tpu import CloudTpuVm, TpuPod
from job.runtime.distributed import Timeouts, bind_address, resolve

Env = dict[str, str]

# The real GCE check, kept before the autouse fixture below replaces it.
_REAL_CLOUD_TPU_IS_PRESENT = CloudTpuVm.is_present


@pytest.fixture(autouse=True)
def _no_gce_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Detection never asks jax's GCE code (or a metadata server) in these tests."""
    monkeypatch.setattr(CloudTpuVm, "is_present", classmethod(lambda cls, env: False))


# --------------------------------------------------------------------------- Slurm tables


def srun_env(
    *,
    job_id: int,
    step_id: int,
    nodelist: str,
    num_nodes: int,
    ntasks: int,
    tasks_per_node: str,
    procid: int,
    localid: int,
    nodeid: int,
    nodename: str,
    **extra: str,
) -> Env:
    """The variables `srun` sets in one task of a job step (Slurm 23.x names)."""
    env = {
        "SLURM_CLUSTER_NAME": "hpc",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_PARTITION": "batch",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(num_nodes),
        "SLURM_NNODES": str(num_nodes),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_TASKS_PER_NODE": tasks_per_node,
        "SLURM_STEP_ID": str(step_id),
        "SLURM_STEPID": str(step_id),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": str(num_nodes),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_GTIDS": str(procid),
        "SLURMD_NODENAME": nodename,
        "SLURM_TOPOLOGY_ADDR": nodename,
        "SLURM_CPUS_ON_NODE": "32",
        "SLURM_SUBMIT_DIR": "/home/user/project",
        "SLURM_SUBMIT_HOST": "login1",
    }
    env.update(extra)
    return env


CPU_4x1 = srun_env(
    job_id=4242, step_id=0, nodelist="node[1-4]", num_nodes=4, ntasks=4, tasks_per_node="1(x4)",
    procid=2, localid=0, nodeid=2, nodename="node3",
)
GPU_2x4 = srun_env(
    job_id=1001, step_id=1, nodelist="gpu[01-02]", num_nodes=2, ntasks=8, tasks_per_node="4(x2)",
    procid=6, localid=2, nodeid=1, nodename="gpu02",
    CUDA_VISIBLE_DEVICES="0,1,2,3", SLURM_GPUS_ON_NODE="4", SLURM_JOB_GPUS="0,1,2,3", SLURM_STEP_GPUS="0,1,2,3",
)
GPU_2x4_PER_TASK = srun_env(  # srun --gpus-per-task=1 with ConstrainDevices: each task sees "its" GPU as 0
    job_id=1001, step_id=2, nodelist="gpu[01-02]", num_nodes=2, ntasks=8, tasks_per_node="4(x2)",
    procid=6, localid=2, nodeid=1, nodename="gpu02",
    CUDA_VISIBLE_DEVICES="0", SLURM_GPUS_PER_TASK="1", SLURM_GPUS_ON_NODE="4", SLURM_STEP_GPUS="2",
)
GPU_PRODUCT_4x2 = srun_env(
    job_id=777, step_id=0, nodelist="gpu-[1-2]-[3-4]", num_nodes=4, ntasks=8, tasks_per_node="2(x4)",
    procid=7, localid=1, nodeid=3, nodename="gpu-2-4", CUDA_VISIBLE_DEVICES="0,1",
)
HETERO_ON_B5 = srun_env(
    job_id=90210, step_id=0, nodelist="a[01-03,07],b5", num_nodes=5, ntasks=9, tasks_per_node="2(x4),1",
    procid=8, localid=0, nodeid=4, nodename="b5", CUDA_VISIBLE_DEVICES="0,1",
)
HETERO_ON_A01 = {**HETERO_ON_B5, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
                 "SLURM_GTIDS": "0,1", "SLURMD_NODENAME": "a01", "SLURM_TOPOLOGY_ADDR": "a01"}
# sbatch -n 8 then `srun -n 4`: the step is narrower than the allocation.
STEP_NARROWER = {**CPU_4x1, "SLURM_NTASKS": "8", "SLURM_NPROCS": "8", "SLURM_TASKS_PER_NODE": "2(x4)"}
# A table without the optional step/node variables (older Slurm, or a wrapper that drops them).
SLURM_MINIMAL: Env = {
    "SLURM_JOB_ID": "55", "SLURM_STEP_NODELIST": "cn[7-8]", "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
}

# (id, env, expected record)
SLURM_TABLES: tuple[tuple[str, Env, ClusterInfo], ...] = (
    ("cpu-4-nodes-x-1-task", CPU_4x1,
     ClusterInfo("slurm", 2, 4, f"node1:{slurm_port(4242, 0)}", None)),
    ("gpu-2-nodes-x-4-tasks", GPU_2x4,
     ClusterInfo("slurm", 6, 8, f"gpu01:{slurm_port(1001, 1)}", (2,))),
    ("gpu-gpus-per-task-1", GPU_2x4_PER_TASK,
     ClusterInfo("slurm", 6, 8, f"gpu01:{slurm_port(1001, 2)}", (0,))),
    ("gpu-product-nodelist", GPU_PRODUCT_4x2,
     ClusterInfo("slurm", 7, 8, f"gpu-1-3:{slurm_port(777, 0)}", (1,))),
    ("heterogeneous-on-b5", HETERO_ON_B5,
     ClusterInfo("slurm", 8, 9, f"a01:{slurm_port(90210, 0)}", (0, 1))),
    ("heterogeneous-on-a01", HETERO_ON_A01,
     ClusterInfo("slurm", 1, 9, f"a01:{slurm_port(90210, 0)}", (1,))),
    ("step-narrower-than-allocation", STEP_NARROWER,
     ClusterInfo("slurm", 2, 4, f"node1:{slurm_port(4242, 0)}", None)),
    ("minimal-no-step-id", SLURM_MINIMAL,
     ClusterInfo("slurm", 1, 2, f"cn7:{slurm_port(55, 0)}", None)),
)


@pytest.mark.parametrize(("env", "expected"), [r[1:] for r in SLURM_TABLES], ids=[r[0] for r in SLURM_TABLES])
def test_slurm_table(env: Env, expected: ClusterInfo) -> None:
    assert SlurmJob.is_present(env)
    info = detect(env)
    assert info == expected  # every field of the record
    assert dataclasses.astuple(info) == dataclasses.astuple(expected)
    host, port = info.coordinator_address.rsplit(":", 1)
    step = int(env.get("SLURM_STEP_ID", "0"))
    assert int(port) == slurm_port(int(env["SLURM_JOB_ID"]), step)
    assert 61440 <= int(port) <= 65535
    assert host == first_node(env["SLURM_STEP_NODELIST"])


@pytest.mark.parametrize(("env", "expected"), [r[1:] for r in SLURM_TABLES], ids=[r[0] for r in SLURM_TABLES])
def test_every_task_of_a_step_agrees_on_the_coordinator(env: Env, expected: ClusterInfo) -> None:
    """Tasks differ only in PROCID/LOCALID/NODEID; all must derive the same address."""
    other = {**env, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    info = detect(other)
    assert info.coordinator_address == expected.coordinator_address
    assert info.process_id == 0 and info.is_coordinator
    assert info.num_processes == expected.num_processes


def test_slurm_port_range_and_distinct_for_consecutive_jobs() -> None:
    ports = [slurm_port(job, 0) for job in range(123_456, 123_456 + 4096)]
    assert all(61440 <= p <= 65535 for p in ports)
    assert len(set(ports)) == 4096  # 4096 consecutive job ids never collide
    for job in (0, 1, 4095, 4096, 2**31 - 2):
        assert slurm_port(job, 0) != slurm_port(job + 1, 0)
    assert slurm_port(10, 0) != slurm_port(10, 1)  # steps of one job differ too


def test_consecutive_job_ids_give_different_coordinator_ports() -> None:
    first = detect(CPU_4x1)
    second = detect({**CPU_4x1, "SLURM_JOB_ID": "4243", "SLURM_JOBID": "4243"})
    assert first.coordinator_address != second.coordinator_address
    assert first.coordinator_address.split(":")[0] == second.coordinator_address.split(":")[0] == "node1"


def test_slurm_non_numeric_step_id_falls_back_to_step_zero() -> None:
    info = detect({**CPU_4x1, "SLURM_STEP_ID": "extern"})
    assert info.coordinator_address == f"node1:{slurm_port(4242, 0)}"


def test_job_coordinator_port_overrides_slurm_port() -> None:
    info = detect({**GPU_2x4, "JOB_COORDINATOR_PORT": "12345"})
    assert info.coordinator_address == "gpu01:12345"
    assert dataclasses.replace(info, coordinator_address=None) == dataclasses.replace(
        detect(GPU_2x4), coordinator_address=None
    )


def test_slurm_without_nodeid_counts_tasks_when_every_node_runs_as_many() -> None:
    env = {k: v for k, v in GPU_2x4.items() if k != "SLURM_NODEID"}
    assert detect(env).local_device_ids == (2,)  # "4(x2)": four tasks here, whatever the node


def test_slurm_without_nodeid_or_even_nodes_falls_back_to_the_local_id() -> None:
    env = {k: v for k, v in HETERO_ON_A01.items() if k != "SLURM_NODEID"}  # "2(x4),1": which node is this?
    assert detect(env).local_device_ids == (1,)
    cpu = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
    assert detect(cpu).local_device_ids is None


# (id, env, variable the error must name, text the error must hold)
BAD_SLURM_TABLES: tuple[tuple[str, Env, str, str], ...] = (
    ("procid-not-int", {**CPU_4x1, "SLURM_PROCID": "abc"}, "SLURM_PROCID", "'abc'"),
    ("procid-negative", {**CPU_4x1, "SLURM_PROCID": "-1"}, "SLURM_PROCID", "'-1'"),
    ("ntasks-zero", {k: v for k, v in {**CPU_4x1, "SLURM_NTASKS": "0"}.items() if k != "SLURM_STEP_NUM_TASKS"},
     "SLURM_NTASKS", "an integer >= 1"),
    ("step-ntasks-zero", {**CPU_4x1, "SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS", "an integer >= 1"),
    ("procid-equals-ntasks", {**CPU_4x1, "SLURM_PROCID": "4"}, "SLURM_PROCID", "0 <= process id < 4"),
    ("procid-above-ntasks", {**GPU_2x4, "SLURM_PROCID": "9"}, "SLURM_PROCID", "found 9"),
    ("job-id-not-int", {**CPU_4x1, "SLURM_JOB_ID": "x42"}, "SLURM_JOB_ID", "'x42'"),
    ("nodeid-not-int", {**GPU_2x4, "SLURM_NODEID": "n1"}, "SLURM_NODEID", "'n1'"),
    ("localid-not-int", {**GPU_2x4, "SLURM_LOCALID": "?"}, "SLURM_LOCALID", "'?'"),
    ("port-too-big", {**CPU_4x1, "JOB_COORDINATOR_PORT": "99999"}, "JOB_COORDINATOR_PORT", "'99999'"),
    ("port-zero", {**CPU_4x1, "JOB_COORDINATOR_PORT": "0"}, "JOB_COORDINATOR_PORT", "'0'"),
    ("port-not-int", {**CPU_4x1, "JOB_COORDINATOR_PORT": "auto"}, "JOB_COORDINATOR_PORT", "'auto'"),
    ("tasks-per-node-garbage", {**GPU_2x4, "SLURM_TASKS_PER_NODE": "four",
                                "SLURM_STEP_TASKS_PER_NODE": "four"}, "TASKS_PER_NODE", "'four'"),
)


@pytest.mark.parametrize(
    ("env", "variable", "text"), [r[1:] for r in BAD_SLURM_TABLES], ids=[r[0] for r in BAD_SLURM_TABLES]
)
def test_malformed_slurm_table_names_the_variable(env: Env, variable: str, text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        detect(env)
    message = str(caught.value)
    assert variable in message
    assert text in message
    assert "expected " in message and "found " in message and "Fix: " in message


@pytest.mark.parametrize("nodelist", ["node[1-", "node[4-1]", "[1-2]", "a,,b"])
def test_bad_slurm_nodelist_raises_with_the_nodelist(nodelist: str) -> None:
    with pytest.raises(ConfigError) as caught:
        detect({**CPU_4x1, "SLURM_STEP_NODELIST": nodelist})
    assert repr(nodelist) in str(caught.value)


def test_bad_slurm_nodelist_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="SLURM_STEP_NODELIST"):
        detect({**CPU_4x1, "SLURM_STEP_NODELIST": "node[1-"})


def test_bad_step_tasks_per_node_names_the_step_variable() -> None:
    with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE"):
        detect({**GPU_2x4, "SLURM_STEP_TASKS_PER_NODE": "four"})


def test_gpus_per_task_two_keeps_both_devices() -> None:
    env = srun_env(
        job_id=1002, step_id=0, nodelist="gpu[01-02]", num_nodes=2, ntasks=4, tasks_per_node="2(x2)",
        procid=3, localid=1, nodeid=1, nodename="gpu02",
        CUDA_VISIBLE_DEVICES="0,1", SLURM_GPUS_PER_TASK="2", SLURM_GPUS_ON_NODE="4", SLURM_STEP_GPUS="2,3",
    )
    assert detect(env).local_device_ids == (0, 1)


# --------------------------------------------------------------------------- Slurm GPU layouts
#
# Recorded with srun on the GPU-shaped local Slurm (Slurm 22.05, 4 GPUs a node, no device
# cgroups) unless marked "cgroups": there every task sees its GPUs renumbered from 0.
# local_device_ids index the GPUs the task sees after CUDA_VISIBLE_DEVICES.


def gpu_task(ntasks_per_node: int, localid: int, *, nodes: int = 2, nodeid: int = 1, **gpu_vars: str) -> Env:
    """Task `localid` on node `nodeid` of a `--ntasks-per-node` step on 4-GPU nodes, plus its GPU variables."""
    return srun_env(
        job_id=5150, step_id=0, nodelist=f"gpu[1-{nodes}]", num_nodes=nodes, ntasks=nodes * ntasks_per_node,
        tasks_per_node=f"{ntasks_per_node}(x{nodes})", procid=nodeid * ntasks_per_node + localid, localid=localid,
        nodeid=nodeid, nodename=f"gpu{nodeid + 1}", **gpu_vars,
    )


ALL_FOUR = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4", "SLURM_STEP_GPUS": "0,1,2,3"}

# (id, env, expected local_device_ids)
GPU_LAYOUTS: tuple[tuple[str, Env, tuple[int, ...] | None], ...] = (
    # a. --ntasks-per-node=1 --gpus-per-node=4: the one task takes every GPU of its node
    ("a-one-task-per-node-all-gpus", gpu_task(1, 0, **ALL_FOUR), (0, 1, 2, 3)),
    # b. --ntasks-per-node=2 --gpus-per-task=2 under plain srun: physical ids, no SLURM_GPUS_PER_TASK
    ("b-gpus-per-task-2-srun-task-0", gpu_task(2, 0, CUDA_VISIBLE_DEVICES="0,1", SLURM_GPUS_ON_NODE="4",
                                               SLURM_STEP_GPUS="0,1"), (0, 1)),
    ("b-gpus-per-task-2-srun-task-1", gpu_task(2, 1, CUDA_VISIBLE_DEVICES="2,3", SLURM_GPUS_ON_NODE="4",
                                               SLURM_STEP_GPUS="2,3"), (0, 1)),
    # b. the same inside `sbatch --gpus-per-task=2`: the task inherits SLURM_GPUS_PER_TASK and SLURM_JOB_GPUS
    ("b-gpus-per-task-2-sbatch-task-1", gpu_task(2, 1, CUDA_VISIBLE_DEVICES="2,3", SLURM_GPUS_ON_NODE="4",
                                                 SLURM_STEP_GPUS="2,3", SLURM_JOB_GPUS="0,1,2,3",
                                                 SLURM_GPUS_PER_TASK="2"), (0, 1)),
    # b. --ntasks-per-node=4 --gpus-per-task=1: one physical id each
    ("b-gpus-per-task-1-task-3", gpu_task(4, 3, CUDA_VISIBLE_DEVICES="3", SLURM_GPUS_ON_NODE="4",
                                          SLURM_STEP_GPUS="3"), (0,)),
    # c. cgroups: every task sees its GPUs as 0.., with or without SLURM_GPUS_PER_TASK
    ("c-cgroups-gpus-per-task-2", gpu_task(2, 1, CUDA_VISIBLE_DEVICES="0,1", SLURM_GPUS_ON_NODE="4",
                                           SLURM_STEP_GPUS="2,3"), (0, 1)),
    ("c-cgroups-gpus-per-task-2-sbatch", gpu_task(2, 1, CUDA_VISIBLE_DEVICES="0,1", SLURM_GPUS_ON_NODE="4",
                                                  SLURM_STEP_GPUS="2,3", SLURM_GPUS_PER_TASK="2"), (0, 1)),
    ("c-cgroups-gpus-per-task-1", gpu_task(4, 2, CUDA_VISIBLE_DEVICES="0", SLURM_GPUS_ON_NODE="4",
                                           SLURM_STEP_GPUS="2", SLURM_GPUS_PER_TASK="1"), (0,)),
    # d. --ntasks-per-node=4 --gres=gpu:4: every task sees all four; each takes its own
    ("d-four-tasks-share-four-gpus-task-2", gpu_task(4, 2, **ALL_FOUR), (2,)),
    ("d-four-tasks-share-four-gpus-task-0", gpu_task(4, 0, **ALL_FOUR), (0,)),
    # d. --ntasks-per-node=2 --gres=gpu:4: a block of two each
    ("d-two-tasks-share-four-gpus-task-1", gpu_task(2, 1, **ALL_FOUR), (2, 3)),
    # d. --ntasks-per-node=2 --gpus-per-node=2 on a 4-GPU node: the step's two, one each
    ("d-two-tasks-share-the-steps-two", gpu_task(2, 1, CUDA_VISIBLE_DEVICES="0,1", SLURM_GPUS_ON_NODE="2",
                                                 SLURM_STEP_GPUS="0,1"), (1,)),
    # d. one GPU for the node's tasks: nothing to split, every task uses it
    ("d-four-tasks-one-gpu", gpu_task(4, 3, CUDA_VISIBLE_DEVICES="0", SLURM_GPUS_ON_NODE="1",
                                      SLURM_STEP_GPUS="0"), (0,)),
    # e. a CPU job: nothing about GPUs; alone on its node -> every device
    ("e-cpu-one-task-per-node", gpu_task(1, 0), None),
    # a GPU node without GRES looks like a CPU job with several tasks: jax's habit, the local id
    # (a CPU backend ignores it)
    ("no-gres-several-tasks", gpu_task(4, 3), (3,)),
    # GPUs hidden on purpose, or GRES without device files
    ("cuda-visible-devices-empty", gpu_task(4, 1, CUDA_VISIBLE_DEVICES=""), None),
    ("no-device-files", gpu_task(4, 1, CUDA_VISIBLE_DEVICES="NoDevFiles", SLURM_GPUS_ON_NODE="4"), None),
    # only SLURM_JOB_GPUS (no SLURM_GPUS_ON_NODE) tells the node's count: seeing fewer means bound
    ("bound-by-job-gpus-only", gpu_task(2, 1, CUDA_VISIBLE_DEVICES="2,3", SLURM_JOB_GPUS="0,1,2,3"), (0, 1)),
    ("gpu-uuids", gpu_task(2, 1, CUDA_VISIBLE_DEVICES="GPU-a1,GPU-b2,GPU-c3,GPU-d4", SLURM_GPUS_ON_NODE="4"),
     (2, 3)),
)


@pytest.mark.parametrize(("env", "expected"), [r[1:] for r in GPU_LAYOUTS], ids=[r[0] for r in GPU_LAYOUTS])
def test_slurm_gpu_layout(env: Env, expected: tuple[int, ...] | None) -> None:
    assert SlurmJob.local_device_ids(env) == expected
    assert detect(env).local_device_ids == expected


def test_tasks_sharing_a_node_take_disjoint_gpus_that_cover_it() -> None:
    for tasks in (1, 2, 4):
        taken = [SlurmJob.local_device_ids(gpu_task(tasks, i, **ALL_FOUR)) for i in range(tasks)]
        assert sorted(d for ids in taken for d in ids) == [0, 1, 2, 3]


@pytest.mark.parametrize(("tasks", "visible"), [(3, "0,1,2,3"), (8, "0,1,2,3"), (4, "0,1"), (2, "0,1,2")])
def test_an_uneven_gpu_split_is_one_clear_error(tasks: int, visible: str) -> None:
    env = gpu_task(tasks, 1, CUDA_VISIBLE_DEVICES=visible, SLURM_GPUS_ON_NODE=str(len(visible.split(","))))
    with pytest.raises(ConfigError) as caught:
        detect(env)
    message = str(caught.value)
    assert message.startswith("Slurm GPUs per task: expected the ")
    assert f"{len(visible.split(','))} GPUs for {tasks} tasks" in message
    assert f"CUDA_VISIBLE_DEVICES={visible}" in message
    assert "Fix: ask Slurm for whole GPUs per task (--gpus-per-task=K)" in message


def test_a_local_id_beyond_the_tasks_of_the_node_is_refused() -> None:
    with pytest.raises(ConfigError, match="SLURM_LOCALID: expected 0..3"):
        detect({**gpu_task(4, 0, **ALL_FOUR), "SLURM_LOCALID": "4"})


@pytest.mark.parametrize("override", ["env", "argument"])
def test_jax_local_device_ids_or_the_argument_beat_an_uneven_split(override: str) -> None:
    env = gpu_task(3, 1, **ALL_FOUR)
    if override == "env":
        info = resolve({**env, "JAX_LOCAL_DEVICE_IDS": "1"})
    else:
        info = resolve(env, local_device_ids=[1])
    assert info.local_device_ids == (1,)
    assert (info.kind, info.process_id, info.num_processes) == ("slurm", 4, 6)


def test_gpu_counts_slurm_gives() -> None:
    assert SlurmJob.gpus_on_node(gpu_task(2, 1, SLURM_GPUS_ON_NODE="4", SLURM_JOB_GPUS="0,1")) == 4
    assert SlurmJob.gpus_on_node(gpu_task(2, 1, SLURM_JOB_GPUS="0,1,2")) == 3
    assert SlurmJob.gpus_on_node(gpu_task(2, 1, SLURM_STEP_GPUS="0,1")) is None  # the task's ids, not the node's
    assert SlurmJob.task_gpus(gpu_task(2, 1, SLURM_GPUS_ON_NODE="4", SLURM_STEP_GPUS="2,3")) == 2
    assert SlurmJob.task_gpus(gpu_task(2, 1, SLURM_GPUS_ON_NODE="4")) == 4
    assert SlurmJob.task_gpus(gpu_task(2, 1)) == 0
    with pytest.raises(ConfigError, match="SLURM_GPUS_ON_NODE: expected an integer >= 0, found 'four'"):
        SlurmJob.gpus_on_node(gpu_task(2, 1, SLURM_GPUS_ON_NODE="four"))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("0,1,2,3", ("0", "1", "2", "3")), ("3", ("3",)), ("", ()), ("-1", ()), ("0,-1,2", ("0",)),
     ("NoDevFiles", ()), (" 1, 2 ", ("1", "2")), ("GPU-a1,MIG-b2", ("GPU-a1", "MIG-b2"))],
)
def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does(value: str | None, expected: tuple | None) -> None:
    assert visible_gpus({} if value is None else {"CUDA_VISIBLE_DEVICES": value}) == expected


# --------------------------------------------------------------------------- local launcher

LAUNCHER: Env = {
    "JOB_LAUNCH_COORDINATOR": "127.0.0.1:47011",
    "JOB_LAUNCH_NUM_PROCESSES": "4",
    "JOB_LAUNCH_PROCESS_ID": "3",
}

# (id, env, expected record)
LOCAL_TABLES: tuple[tuple[str, Env, ClusterInfo], ...] = (
    ("launcher", LAUNCHER, ClusterInfo("local", 3, 4, "127.0.0.1:47011", None)),
    ("launcher-one-process", {**LAUNCHER, "JOB_LAUNCH_NUM_PROCESSES": "1", "JOB_LAUNCH_PROCESS_ID": "0"},
     ClusterInfo("local", 0, 1, "127.0.0.1:47011", None)),
    ("launcher-inside-slurm", {**CPU_4x1, **LAUNCHER}, ClusterInfo("local", 3, 4, "127.0.0.1:47011", None)),
)


@pytest.mark.parametrize(("env", "expected"), [r[1:] for r in LOCAL_TABLES], ids=[r[0] for r in LOCAL_TABLES])
def test_local_table(env: Env, expected: ClusterInfo) -> None:
    assert detect(env) == expected


@pytest.mark.parametrize(("num", "pid"), [(1, 0), (2, 1), (8, 0), (8, 7)])
def test_launcher_variables_round_trip_through_detect(num: int, pid: int) -> None:
    env = LocalLauncher.variables("10.1.2.3:5555", num, pid)
    assert set(env) == set(LocalLauncher.required)
    assert all(isinstance(v, str) for v in env.values())
    assert detect(env) == ClusterInfo("local", pid, num, "10.1.2.3:5555", None)


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({**LAUNCHER, "JOB_LAUNCH_PROCESS_ID": "x"}, "JOB_LAUNCH_PROCESS_ID"),
        ({**LAUNCHER, "JOB_LAUNCH_NUM_PROCESSES": "0"}, "JOB_LAUNCH_NUM_PROCESSES"),
        ({**LAUNCHER, "JOB_LAUNCH_PROCESS_ID": "4"}, "JOB_LAUNCH_PROCESS_ID"),
    ],
    ids=["pid-not-int", "num-zero", "pid-out-of-range"],
)
def test_malformed_launcher_table(env: Env, variable: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        detect(env)


# --------------------------------------------------------------------------- TPU tables

GKE_HOSTS = ",".join(f"tpu-job-0-{i}.tpu-job" for i in range(4))
GKE_TPU: Env = {
    "TPU_WORKER_ID": "2",
    "TPU_WORKER_HOSTNAMES": GKE_HOSTS,
    "TPU_ACCELERATOR_TYPE": "v5litepod-16",
    "TPU_TOPOLOGY": "4x4",
    "TPU_SKIP_MDS_QUERY": "true",
    "HOSTNAME": "tpu-job-0-2",
}
PROCESS_ADDRESSES_TPU: Env = {
    "TPU_WORKER_ID": "3",
    "TPU_PROCESS_ADDRESSES": "10.0.0.1:8476,10.0.0.2:8476,10.0.0.3:8476,10.0.0.4:8476",
    "TPU_PROCESS_PORT": "8476",
}
MULTISLICE_TPU: Env = {
    **GKE_TPU,
    "MEGASCALE_NUM_SLICES": "2",
    "MEGASCALE_SLICE_ID": "1",
    "MEGASCALE_COORDINATOR_ADDRESS": "tpu-job-slice-0-0.tpu-job:8080",
    "MEGASCALE_PORT": "8080",
}

# (id, env, expected record)
TPU_TABLES: tuple[tuple[str, Env, ClusterInfo], ...] = (
    ("gke-4-workers", GKE_TPU, ClusterInfo("tpu", 2, 4, "tpu-job-0-0.tpu-job:8482", None)),
    ("gke-worker-0", {**GKE_TPU, "TPU_WORKER_ID": "0"}, ClusterInfo("tpu", 0, 4, "tpu-job-0-0.tpu-job:8482", None)),
    ("process-addresses-host-port", PROCESS_ADDRESSES_TPU, ClusterInfo("tpu", 3, 4, "10.0.0.1:8482", None)),
    ("multislice", MULTISLICE_TPU, ClusterInfo("tpu", 2 + 1 * 4, 8, "tpu-job-slice-0-0.tpu-job:8482", None)),
    ("multislice-coordinator-without-port",
     {**MULTISLICE_TPU, "MEGASCALE_COORDINATOR_ADDRESS": "tpu-job-slice-0-0.tpu-job", "MEGASCALE_SLICE_ID": "0"},
     ClusterInfo("tpu", 2, 8, "tpu-job-slice-0-0.tpu-job:8482", None)),
    ("port-override", {**GKE_TPU, "JOB_COORDINATOR_PORT": "9999"},
     ClusterInfo("tpu", 2, 4, "tpu-job-0-0.tpu-job:9999", None)),
)


@pytest.mark.parametrize(("env", "expected"), [r[1:] for r in TPU_TABLES], ids=[r[0] for r in TPU_TABLES])
def test_tpu_table(env: Env, expected: ClusterInfo) -> None:
    assert TpuPod.is_present(env)
    assert detect(env) == expected


def test_tpu_workers_strip_ports() -> None:
    assert TpuPod.workers(PROCESS_ADDRESSES_TPU) == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
    assert TpuPod.workers(GKE_TPU) == GKE_HOSTS.split(",")


def test_multislice_process_ids_cover_every_slot_once() -> None:
    seen = {
        detect({**MULTISLICE_TPU, "TPU_WORKER_ID": str(w), "MEGASCALE_SLICE_ID": str(s)}).process_id
        for w in range(4)
        for s in range(2)
    }
    assert seen == set(range(8))


# (id, env, variable the error must name)
BAD_TPU_TABLES: tuple[tuple[str, Env, str], ...] = (
    ("worker-id-equals-hosts", {**GKE_TPU, "TPU_WORKER_ID": "4"}, "TPU_WORKER_ID"),
    ("worker-id-negative", {**GKE_TPU, "TPU_WORKER_ID": "-1"}, "TPU_WORKER_ID"),
    ("worker-id-not-int", {**GKE_TPU, "TPU_WORKER_ID": "w2"}, "TPU_WORKER_ID"),
    ("empty-host-entry", {**GKE_TPU, "TPU_WORKER_HOSTNAMES": "a,,b"}, "TPU_WORKER_HOSTNAMES"),
    ("slice-id-out-of-range", {**MULTISLICE_TPU, "MEGASCALE_SLICE_ID": "2"}, "MEGASCALE_SLICE_ID"),
    ("num-slices-zero", {**MULTISLICE_TPU, "MEGASCALE_NUM_SLICES": "0"}, "MEGASCALE_NUM_SLICES"),
    ("port-too-big", {**GKE_TPU, "JOB_COORDINATOR_PORT": "70000"}, "JOB_COORDINATOR_PORT"),
)


@pytest.mark.parametrize(("env", "variable"), [r[1:] for r in BAD_TPU_TABLES], ids=[r[0] for r in BAD_TPU_TABLES])
def test_malformed_tpu_table(env: Env, variable: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        detect(env)


def test_tpu_worker_list_from_a_process_addresses_file_wins_as_in_jax_0_12(tmp_path: Path) -> None:
    listed = tmp_path / "addresses"
    listed.write_text("10.1.0.1:8476,10.1.0.2:8476\n")
    env = {"TPU_WORKER_ID": "1", "TPU_PROCESS_ADDRESSES_PATH": str(listed), "TPU_WORKER_HOSTNAMES": "a,b,c,d"}
    assert TpuPod.is_present(env)
    assert detect(env) == ClusterInfo("tpu", 1, 2, "10.1.0.1:8482", None)


@pytest.mark.parametrize("content", [None, "", "a,,b"])
def test_an_unreadable_or_malformed_process_addresses_file_is_one_clear_error(tmp_path: Path,
                                                                              content: str | None) -> None:
    listed = tmp_path / "addresses"
    if content is not None:
        listed.write_text(content)
    with pytest.raises(ConfigError, match="TPU_PROCESS_ADDRESSES_PATH") as err:
        detect({"TPU_WORKER_ID": "0", "TPU_PROCESS_ADDRESSES_PATH": str(listed)})
    assert "expected" in str(err.value) and "Fix" in str(err.value)


def test_tpu_ipv6_process_address_port_is_replaced() -> None:
    env = {"TPU_WORKER_ID": "0", "TPU_PROCESS_ADDRESSES": "[fd00::1]:8476,[fd00::2]:8476"}
    assert detect(env).coordinator_address == "[fd00::1]:8482"


def test_cloud_tpu_vm_is_not_present_on_this_machine() -> None:
    assert _REAL_CLOUD_TPU_IS_PRESENT({}) is False


# --------------------------------------------------------------------------- detection order


def test_every_kind_jobs_cluster_accepts_is_one_an_environment_detects() -> None:
    # the order itself is proven by behaviour: DETECTION_TABLES below (launcher beats slurm beats tpu)
    assert KINDS == ("local", "slurm", "tpu", "single")  # derived from DETECTION_ORDER, in its order


# (id, env, expected kind)
DETECTION_TABLES: tuple[tuple[str, Env, str], ...] = (
    ("launcher-beats-slurm", {**CPU_4x1, **LAUNCHER}, "local"),
    ("launcher-beats-tpu", {**GKE_TPU, **LAUNCHER}, "local"),
    ("slurm-beats-tpu", {**CPU_4x1, **GKE_TPU}, "slurm"),
    ("nothing", {}, "single"),
    ("unrelated-variables", {"HOME": "/root", "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_ID": "5"}, "single"),
    ("forced-single-inside-slurm", {**CPU_4x1, "JOB_CLUSTER": "single"}, "single"),
    ("forced-slurm-skips-launcher", {**CPU_4x1, **LAUNCHER, "JOB_CLUSTER": "slurm"}, "slurm"),
    ("forced-tpu-skips-slurm", {**CPU_4x1, **GKE_TPU, "JOB_CLUSTER": "tpu"}, "tpu"),
    ("forced-local", {**LAUNCHER, "JOB_CLUSTER": "local"}, "local"),
)


@pytest.mark.parametrize(("env", "kind"), [r[1:] for r in DETECTION_TABLES], ids=[r[0] for r in DETECTION_TABLES])
def test_detection(env: Env, kind: str) -> None:
    assert detect(env).kind == kind


def test_nothing_detected_is_single_process() -> None:
    info = detect({})
    assert info == SINGLE
    assert info == ClusterInfo("single", 0, 1, None, None)
    assert not info.is_multiprocess and info.is_coordinator


def test_forced_single_inside_slurm_is_the_single_record() -> None:
    assert detect({**GPU_2x4, "JOB_CLUSTER": "single"}) == SINGLE


def test_detect_reads_only_the_given_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in GPU_2x4.items():
        monkeypatch.setenv(key, value)
    assert detect({}) == SINGLE


def test_detect_asks_gce_only_after_everything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Env] = []

    def not_present(cls: type, env: Env) -> bool:
        calls.append(dict(env))
        return False

    monkeypatch.setattr(CloudTpuVm, "is_present", classmethod(not_present))
    assert detect({}) == SINGLE
    assert calls == [{}]
    calls.clear()
    assert detect(CPU_4x1).kind == "slurm"
    assert detect(GKE_TPU).kind == "tpu"
    assert calls == []  # an earlier match never reaches the GCE check


# --------------------------------------------------------------------------- what the library asks of a cluster

HOST = socket.gethostname()
# (id, env, (processes on this host, array index, node name, task's GPUs)) as the detected class answers
ASKED_TABLES: tuple[tuple[str, Env, tuple[int | None, int | None, str, int]], ...] = (
    ("launcher", LAUNCHER, (4, None, HOST, 0)),
    ("launcher-inside-slurm", {**GPU_2x4, **LAUNCHER}, (4, None, HOST, 0)),  # the launcher answers, not Slurm
    ("slurm-gpus", GPU_2x4, (4, None, "gpu02", 4)),
    ("slurm-array-element", {**CPU_4x1, "SLURM_ARRAY_TASK_ID": "5"}, (1, 5, "node3", 0)),
    ("slurm-uneven-nodes", HETERO_ON_B5, (1, None, "b5", 0)),
    ("slurm-forced-single", {**GPU_2x4, "JOB_CLUSTER": "single"}, (None, None, HOST, 0)),
    ("tpu-worker", GKE_TPU, (None, None, HOST, 0)),
    ("nothing", {}, (None, None, HOST, 0)),
)


@pytest.mark.parametrize(("env", "expected"), [r[1:] for r in ASKED_TABLES], ids=[r[0] for r in ASKED_TABLES])
def test_the_detected_environment_answers_what_the_library_asks_of_a_cluster(
        env: Env, expected: tuple[int | None, int | None, str, int]) -> None:
    found = environment(env)
    assert found.kind == detect(env).kind
    assert (found.processes_on_this_host(env), found.array_index(env), found.node_name(env),
            found.task_gpus(env)) == expected
    assert node_name(env) == expected[2]


def test_the_variables_set_per_process_are_each_environments_own_and_none_shared() -> None:
    assert set(LocalLauncher.variables("10.1.2.3:5555", 4, 1)) <= PER_PROCESS  # what the launcher hands each child
    assert {"SLURM_PROCID", "SLURM_LOCALID", "TPU_WORKER_ID"} <= PER_PROCESS
    assert not {"SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "JOB_COORDINATOR_PORT"} & PER_PROCESS  # the same everywhere


def test_an_array_index_that_is_not_a_number_names_its_variable() -> None:
    with pytest.raises(ConfigError, match="SLURM_ARRAY_TASK_ID: expected an integer >= 0, found 'x'"):
        environment({**CPU_4x1, "SLURM_ARRAY_TASK_ID": "x"}).array_index({**CPU_4x1, "SLURM_ARRAY_TASK_ID": "x"})


@pytest.mark.parametrize(
    ("forced", "env", "needed"),
    [
        ("tpu", {}, "TPU_WORKER_ID"),
        ("tpu", CPU_4x1, "TPU_WORKER_ID"),
        ("slurm", LAUNCHER, "SLURM_STEP_NODELIST"),
        ("local", CPU_4x1, "JOB_LAUNCH_COORDINATOR"),
    ],
    ids=["tpu-empty", "tpu-in-slurm", "slurm-in-launcher", "local-in-slurm"],
)
def test_forced_kind_without_its_variables(forced: str, env: Env, needed: str) -> None:
    with pytest.raises(ConfigError) as caught:
        detect({**env, "JOB_CLUSTER": forced})
    message = str(caught.value)
    assert f"JOB_CLUSTER={forced}" in message
    assert needed in message
    assert "Fix: " in message


@pytest.mark.parametrize("forced", ["bogus", "SLURM", "", "manual"])
def test_unknown_forced_kind_lists_the_kinds(forced: str) -> None:
    with pytest.raises(ConfigError) as caught:
        detect({"JOB_CLUSTER": forced})
    message = str(caught.value)
    assert "JOB_CLUSTER" in message
    assert "one of local, slurm, tpu, single" in message
    assert repr(forced) in message


# --------------------------------------------------------------------------- overrides (resolve)


def test_jax_coordinator_address_overrides_detection() -> None:
    info = resolve({**GPU_2x4, "JAX_COORDINATOR_ADDRESS": "head:1234"})
    assert info == ClusterInfo("slurm", 6, 8, "head:1234", (2,))


def test_jax_local_device_ids_override() -> None:
    assert resolve({"JAX_LOCAL_DEVICE_IDS": "0,2"}).local_device_ids == (0, 2)
    assert resolve({**GPU_2x4, "JAX_LOCAL_DEVICE_IDS": "0,2"}).local_device_ids == (0, 2)


def test_explicit_arguments_beat_environment() -> None:
    env = {**GPU_2x4, "JAX_COORDINATOR_ADDRESS": "env:1", "JAX_LOCAL_DEVICE_IDS": "0,2"}
    info = resolve(env, coordinator_address="arg:2", local_device_ids=[3], process_id=1, num_processes=2)
    assert info == ClusterInfo("slurm", 1, 2, "arg:2", (3,))


def test_explicit_arguments_without_detection_are_manual() -> None:
    info = resolve({}, num_processes=2, process_id=1, coordinator_address="h:1")
    assert info == ClusterInfo("manual", 1, 2, "h:1", None)


def test_env_coordinator_with_explicit_counts_is_manual() -> None:
    info = resolve({"JAX_COORDINATOR_ADDRESS": "h:7"}, num_processes=3, process_id=2)
    assert info == ClusterInfo("manual", 2, 3, "h:7", None)


def test_nothing_to_override_returns_detection_unchanged() -> None:
    assert resolve({}) is SINGLE
    assert resolve(CPU_4x1) == detect(CPU_4x1)


@pytest.mark.parametrize(
    ("env", "kwargs", "what"),
    [
        ({}, {"num_processes": 2, "process_id": 2, "coordinator_address": "h:1"}, "process_id"),
        ({}, {"num_processes": 2, "process_id": -1, "coordinator_address": "h:1"}, "process_id"),
        ({}, {"num_processes": 0, "process_id": 0}, "num_processes"),
        (CPU_4x1, {"process_id": 4}, "process_id"),
        ({}, {"num_processes": 2, "process_id": 0}, "coordinator_address"),
        ({}, {"num_processes": 2, "process_id": 0, "coordinator_address": "h"}, "coordinator_address"),
        ({"JAX_COORDINATOR_ADDRESS": "h"}, {"num_processes": 2, "process_id": 0}, "coordinator_address"),
        ({"JAX_LOCAL_DEVICE_IDS": "0,x"}, {}, "JAX_LOCAL_DEVICE_IDS"),
        ({"JAX_LOCAL_DEVICE_IDS": ""}, {}, "JAX_LOCAL_DEVICE_IDS"),
        ({"JAX_LOCAL_DEVICE_IDS": "-1"}, {}, "JAX_LOCAL_DEVICE_IDS"),
    ],
    ids=[
        "pid-equals-num", "pid-negative", "num-zero", "pid-beyond-slurm", "multi-without-coordinator",
        "coordinator-without-port", "env-coordinator-without-port", "device-ids-not-int", "device-ids-empty",
        "device-ids-negative",
    ],
)
def test_resolve_rejects(env: Env, kwargs: dict[str, object], what: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve(env, **kwargs)
    assert str(caught.value).startswith(what)
    assert "Fix: " in str(caught.value)


# --------------------------------------------------------------------------- Timeouts


def test_timeouts_defaults() -> None:
    assert Timeouts.from_env({}) == Timeouts(init_s=120, heartbeat_s=10, shutdown_s=60)


@pytest.mark.parametrize(
    ("variable", "field"),
    [("JOB_INIT_TIMEOUT", "init_s"), ("JOB_HEARTBEAT_TIMEOUT", "heartbeat_s"), ("JOB_SHUTDOWN_TIMEOUT", "shutdown_s")],
)
def test_timeouts_each_override(variable: str, field: str) -> None:
    timeouts = Timeouts.from_env({variable: "7"})
    assert getattr(timeouts, field) == 7
    assert timeouts == dataclasses.replace(Timeouts(), **{field: 7})


@pytest.mark.parametrize("value", ["soon", "0", "-3", "1.5", ""])
@pytest.mark.parametrize("variable", ["JOB_INIT_TIMEOUT", "JOB_HEARTBEAT_TIMEOUT", "JOB_SHUTDOWN_TIMEOUT"])
def test_timeouts_bad_value(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Timeouts.from_env({variable: value})
    message = str(caught.value)
    assert message.startswith(variable)
    assert repr(value) in message and "Fix: " in message


# --------------------------------------------------------------------------- small pieces


def test_config_error_parts() -> None:
    err = ConfigError("THING", expected="a widget", found="gadget", fix="use a widget")
    assert isinstance(err, ValueError)
    assert str(err) == "THING: expected a widget, found 'gadget'. Fix: use a widget"
    assert (err.what, err.expected, err.found, err.fix) == ("THING", "a widget", "gadget", "use a widget")


def test_read_helpers() -> None:
    assert read_int({"N": "5"}, "N", fix="f") == 5
    with pytest.raises(ConfigError, match="N: expected an integer >= 0, found None"):
        read_int({}, "N", fix="f")
    with pytest.raises(ConfigError, match="an integer >= 2"):
        read_int({"N": "1"}, "N", minimum=2, fix="f")
    assert read_port({"P": "65535"}, "P", fix="f") == 65535
    with pytest.raises(ConfigError, match="TCP port"):
        read_port({"P": "65536"}, "P", fix="f")
    assert read_id_list({"D": "0,1,3"}, "D", fix="f") == (0, 1, 3)
    for bad in (" 4", "+4", "4_0", "\u0664", "-1", ""):  # what job.core.values.whole refuses, in any variable
        with pytest.raises(ConfigError, match="N: expected an integer >= 0"):
            read_int({"N": bad}, "N", fix="f")
        with pytest.raises(ConfigError, match="D: expected comma-separated device ids"):
            read_id_list({"D": f"0,{bad}"}, "D", fix="f")


def test_cluster_info_record() -> None:
    info = ClusterInfo("slurm", 0, 8, "gpu01:61500", (0, 3))
    assert info.is_coordinator and info.is_multiprocess
    assert info.summary() == "slurm cluster: process 0 of 8, coordinator gpu01:61500, local devices 0,3"
    assert SINGLE.summary() == "single cluster: process 0 of 1, coordinator -, local devices all"
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.process_id = 1  # type: ignore[misc]


# --------------------------------------------------------------------------- initialize (subprocess)


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    keep = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PYTHONPATH")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


def test_initialize_after_jax_computation_fails_with_init_order_error() -> None:
    proc = _run_python(
        """
        import jax; jax.devices(); import job
        job.initialize(num_processes=2, process_id=0, coordinator_address='127.0.0.1:1')
        """
    )
    assert proc.returncode != 0, proc.stdout
    assert "job.errors.InitOrderError" in proc.stderr
    assert "job.initialize() must run before any JAX computation" in proc.stderr
    assert "Fix: call job.initialize() at the very top of main()" in proc.stderr


def test_initialize_single_starts_nothing() -> None:
    proc = _run_python(
        """
        import jax, job
        from job.core import internals
        info = job.initialize(env={})
        print(info.kind, info.num_processes, info.coordinator_address)
        print(jax.distributed.is_initialized(), internals.backends_are_initialized())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["single 1 None", "False False"]


# ------------------------------------------------------------------ coordinator bind address


def _resolver(table: dict[str, str]):
    def resolve(host: str) -> str:
        if host not in table:
            raise OSError(f"unknown host {host}")
        return table[host]

    return resolve


@pytest.mark.parametrize(
    ("address", "table", "expected"),
    [
        ("127.0.0.1:1234", {"127.0.0.1": "127.0.0.1"}, "127.0.0.1:1234"),  # the local launcher
        ("localhost:1234", {"localhost": "127.0.0.1"}, "127.0.0.1:1234"),
        ("[::1]:1234", {"::1": "::1"}, "[::1]:1234"),
        # a node's own name that resolves to loopback here (Debian's 127.0.1.1 line):
        # its peers reach it on the network, so every interface listens
        ("node1:1234", {"node1": "127.0.1.1"}, None),
        ("far-away:1234", {"far-away": "198.51.100.250"}, None),  # another machine's address
        ("nowhere:1234", {}, None),  # does not resolve here
    ],
)
def test_coordinator_bind_address(address: str, table: dict[str, str], expected: str | None) -> None:
    assert bind_address(address, {}, resolve=_resolver(table)) == expected


def test_coordinator_binds_to_this_machines_network_address() -> None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # no packet is sent: this picks the outgoing interface
        except OSError as exc:
            pytest.skip(f"no route off this machine ({exc})")
        mine = s.getsockname()[0]
    if mine.startswith("127."):
        pytest.skip(f"no network interface besides loopback (found {mine})")
    assert bind_address("node7:61440", {}, resolve=_resolver({"node7": mine})) == f"{mine}:61440"


def test_coordinator_bind_address_from_the_environment_wins() -> None:
    env = {"JAX_COORDINATOR_BIND_ADDRESS": "10.0.0.5:999"}
    assert bind_address("127.0.0.1:1234", env, resolve=_resolver({})) == "10.0.0.5:999"


def test_a_cloud_tpu_vms_port_override_is_read_as_every_port_is(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str | None] = []

    class Metadata:  # stands in for jax's GCE TPU cluster, which asks the metadata server
        @staticmethod
        def get_coordinator_address(timeout_secs: int, override_coordinator_port: str | None) -> str:
            asked.append(override_coordinator_port)
            return f"10.0.0.2:{override_coordinator_port or 8476}"

    monkeypatch.setattr(CloudTpuVm, "_jax_env", classmethod(lambda cls: Metadata))
    assert CloudTpuVm.coordinator_address({}) == "10.0.0.2:8476"
    assert CloudTpuVm.coordinator_address({"JOB_COORDINATOR_PORT": "9999"}) == "10.0.0.2:9999"
    for bad in ("auto", "0", "99999", " 9999", "\u0669\u0669"):
        with pytest.raises(ConfigError, match="JOB_COORDINATOR_PORT: expected "):
            CloudTpuVm.coordinator_address({"JOB_COORDINATOR_PORT": bad})
    assert asked == [None, "9999"]


@pytest.mark.parametrize(("step", "port_of"), [("3", 3), ("extern", 0), ("", 0), ("\u0663", 0)])
def test_the_slurm_port_follows_a_numbered_step_and_takes_0_for_any_other(step: str, port_of: int) -> None:
    info = detect({**CPU_4x1, "SLURM_STEP_ID": step})
    assert info.coordinator_address.endswith(f":{slurm_port(int(CPU_4x1['SLURM_JOB_ID']), port_of)}")
