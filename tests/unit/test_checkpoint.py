"""A real (single-process) Checkpointer: saves from the live state (nothing copied on the devices), what a save needs
of the host, what it reads, its failure message."""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from job.runs import checkpoint, headroom
from job.runs.checkpoint import Checkpointer, CheckpointError, abstract
from job.runs.config import CheckpointConfig
from job.runtime import host, priority


def _state(offset: float = 0.0) -> dict:
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    return {"w": jax.device_put(np.arange(64.0, dtype=np.float32).reshape(16, 4) + offset, rows),
            "b": jax.device_put(np.full(4, offset, np.float32), NamedSharding(mesh, PartitionSpec())),
            "count": np.array(7), "name": "kept"}


def test_a_save_copies_nothing_on_the_devices_and_keeps_its_step_while_the_loop_donates_it(tmp_path: Path) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig(), like=abstract(_state()))
    state = _state(5.0)
    step = jax.jit(lambda w: w * 0 - 1, donate_argnums=0)
    step(_state()["w"])  # compiled before: it runs the moment save returns
    before = {id(x) for x in jax.live_arrays()}
    buffers = {shard.data.unsafe_buffer_pointer() for key in ("w", "b") for shard in state[key].addressable_shards}
    checkpoints.save(3, state)
    assert checkpoints.writing() or checkpoints.latest_step() == 3
    # orbax hands each shard on as an array of its own: a view of the live buffer, never a new one
    made = [x for x in jax.live_arrays() if id(x) not in before and x.unsafe_buffer_pointer() not in buffers]
    assert made == [], f"the save made {len(made)} arrays on the devices: {[x.shape for x in made]}"
    state["w"] = step(state["w"])  # the next step overwrites the array in place while the save runs
    assert state["w"].sharding.is_equivalent_to(_state()["w"].sharding, 2)  # (in place: same layout)
    checkpoints.wait()
    back = checkpoints.restore(3, _state())
    np.testing.assert_array_equal(np.asarray(back["w"]), np.arange(64.0).reshape(16, 4) + 5.0)
    np.testing.assert_array_equal(np.asarray(back["b"]), np.full(4, 5.0))
    assert back["w"].sharding.is_equivalent_to(_state()["w"].sharding, 2)
    assert int(back["count"]) == 7
    checkpoints.close()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_save_that_cannot_start_is_one_error_naming_the_step(async_save: bool, tmp_path: Path) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=async_save))
    unsaveable = {"w": jnp.ones(3), "lock": threading.Lock()}  # orbax has no handler for a lock
    with pytest.raises(CheckpointError, match=r"^checkpoint: expected to write step 4 to .*ck, found ") as err:
        checkpoints.save(4, unsaveable)
        checkpoints.wait()
    assert "Complete checkpoints on disk: none" in str(err.value)
    checkpoints.close()


def test_the_write_runs_at_a_low_cpu_priority_and_the_loop_does_not(tmp_path: Path) -> None:
    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    for step in (1, 2):  # tensorstore's pool grows while it writes; the threads stay for the next save
        checkpoints.save(step, _state())
        checkpoints.wait()
    checkpoints._lowering.join()  # noqa: SLF001 - lowered on a thread of its own, off the loop's
    writers = priority.threads_named(checkpoint.WRITER_THREADS)  # (a thread may end while they are listed)
    assert writers, "tensorstore's threads wrote the arrays"
    for tid in writers:
        assert os.getpriority(os.PRIO_PROCESS, tid) >= checkpoint.WRITER_NICE
    checkpoints.save(3, _state())
    checkpoints._lowering.join()  # noqa: SLF001
    committing = [t for t in threading.enumerate() if t.name == checkpoint.ORBAX_COMMIT_THREAD and t.is_alive()]
    for thread in committing:  # orbax's own thread, waiting for the write and committing it (while it runs)
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) >= checkpoint.WRITER_NICE
    checkpoints.wait()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice
    checkpoints.close()


def test_on_an_accelerator_the_write_keeps_its_priority_and_no_thread_reads_proc(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the step computes on the chip: lowering the writers gained nothing on a TPU VM (bench.ckpt.loop: no-scan), and
    # finding them reads every thread's name in /proc
    class Chip:
        platform = "tpu"

    monkeypatch.setattr(checkpoint.jax, "local_devices", lambda: [Chip()])
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    monkeypatch.undo()
    checkpoints.save(1, _state())
    checkpoints.wait()
    checkpoints.save(2, _state())
    assert checkpoints._lowering is None  # noqa: SLF001 - no thread was started to lower them
    checkpoints.close()


def test_a_save_leaves_the_collector_and_the_allocator_as_they_are(tmp_path: Path) -> None:
    # in the real loop on a TPU VM neither the collector's pause nor glibc's kept heap shortened the save's block or
    # the steps beside the write (bench.ckpt.loop: no-gc-pause, no-mallopt); the loop's process is left its own
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            checkpoints = Checkpointer(tmp_path / f"ck{enabled}", CheckpointConfig())
            checkpoints.save(1, _state())
            while checkpoints.writing():  # the loop asks after every step: a question, nothing else
                assert gc.isenabled() is enabled
                time.sleep(0.01)
            checkpoints.save(2, _state())
            checkpoints.close()  # closed while writing
            assert gc.isenabled() is enabled
        finally:
            gc.enable()


def test_a_failed_write_is_raised_by_wait_and_leaves_the_collector_on(tmp_path: Path) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    with pytest.raises(CheckpointError):
        checkpoints.save(4, {"w": jnp.ones(3), "lock": threading.Lock()})
        checkpoints.wait()
    checkpoints.close()
    assert gc.isenabled()


def test_checkpoints_written_with_orbax_defaults_still_restore(tmp_path: Path) -> None:
    # zstd-compressed, per-replica slices: what the template wrote before; a resumed run must read it
    with ocp.CheckpointManager(tmp_path / "ck", options=ocp.CheckpointManagerOptions(create=True)) as old:
        old.save(6, args=ocp.args.StandardSave({"w": _state(2.0)["w"]}))
        old.wait_until_finished()
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    step, back = checkpoints.restore_newest({"w": _state()["w"]})
    assert step == 6
    np.testing.assert_array_equal(np.asarray(back["w"]), np.arange(64.0).reshape(16, 4) + 2.0)
    checkpoints.close()


def test_a_failed_save_names_the_step_the_cause_and_what_is_safe(tmp_path: Path) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    for name in ("2", "4", "6.orbax-checkpoint-tmp"):
        (tmp_path / "ck" / name).mkdir()
    cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    wrapped = ValueError("RESOURCE_EXHAUSTED: Error writing ... [os_error_code='28']")
    wrapped.__cause__ = cause
    text = str(checkpoints._failed(6, wrapped))
    assert text.startswith(f"checkpoint: expected to write step 6 to {tmp_path / 'ck'}, found No space left on device")
    assert "Complete checkpoints on disk: [2, 4] (a rerun resumes from step 4)" in text
    assert "Fix: free space in" in text
    checkpoints.close()


def test_the_message_survives_a_folder_that_cannot_be_listed(tmp_path: Path) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    shutil.rmtree(tmp_path / "ck")
    text = str(checkpoints._failed(8, OSError(errno.EIO, os.strerror(errno.EIO))))
    assert "found Input/output error (OSError:" in text
    assert "Complete checkpoints on disk: unknown (cannot list the folder: No such file or directory)" in text
    checkpoints.close()


GIB = 2**30


def test_what_a_save_holds_on_the_host_is_one_replica_of_this_processs_shards_planned_or_made() -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    state = {"rows": jax.device_put(np.zeros((8, 6), np.float32), NamedSharding(mesh, PartitionSpec("data"))),
             "whole": jax.device_put(np.zeros((10,), np.float32), NamedSharding(mesh, PartitionSpec())),
             "split": jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, PartitionSpec("data", "model"))),
             "count": np.array(3)}
    # rows: 4 row blocks (each on 2 devices) of 2 x 6; whole: once; split: 8 blocks of 2 x 2: every byte once
    assert headroom.host_bytes(state) == 4 * (8 * 6 + 10 + 8 * 4)
    assert headroom.host_bytes(abstract(state)) == headroom.host_bytes(state)


def test_a_host_copy_that_does_not_fit_goes_in_batches_sized_for_every_process_on_the_host() -> None:
    assert headroom.weigh(GIB, None, 4).fits  # nothing says what is available: at once
    roomy = headroom.weigh(2 * GIB, 100 * GIB, 4)
    assert roomy == headroom.HostFit(8 * GIB, 100 * GIB, 4) and roomy.fits
    tight = headroom.weigh(20 * GIB, 40 * GIB, 4)  # 80 GiB for 4 processes, 40 available
    assert not tight.fits and tight.batch_gb() == pytest.approx(0.9 * 40 * GIB / 4 / 1e9)  # 9.66 GB a process
    assert headroom.weigh(GIB, GIB, 1).batch_gb() == pytest.approx(0.9 * GIB / 1e9)
    assert tight.line() == ("checkpoint: a save's copy of the state needs 80.0 GiB of host memory for the 4 "
                            "processes on this host, more than 90% of the 40.0 GiB available; the state goes to "
                            "the host in batches of 9.66 GB a process, each written before the next is copied, the "
                            "loop waiting for the last copy")


def test_a_checkpointer_whose_host_copy_does_not_fit_saves_in_batches_and_restores_bitwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(headroom, "host_available", lambda: 100)  # bytes: less than the state's 272
    given, made = [], ocp.PyTreeCheckpointHandler
    monkeypatch.setattr(ocp, "PyTreeCheckpointHandler", lambda **kw: given.append(kw) or made(**kw))
    # what orbax does: each array's copy to the host and the end of its write, in order
    events: list[tuple[str, str]] = []
    copied, written = checkpoint._Transfers.on_transfer_end, checkpoint._Transfers.on_write_end  # noqa: SLF001
    monkeypatch.setattr(checkpoint._Transfers, "on_transfer_end",  # noqa: SLF001
                        lambda self, key: events.append(("copied", jax.tree_util.keystr(key))) or copied(self, key))
    monkeypatch.setattr(checkpoint._Transfers, "on_write_end",  # noqa: SLF001
                        lambda self, key: events.append(("written", jax.tree_util.keystr(key))) or written(self, key))
    caplog.set_level(logging.INFO, logger=checkpoint.__name__)
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig(), like=abstract(_state()))
    assert checkpoints.host == headroom.HostFit(272, 100, 1)  # w's 256 bytes over 8 devices, b's 16 once
    assert [kw["save_device_host_concurrent_gb"] for kw in given] == [pytest.approx(90 / 1e9)]  # 90% of 100 bytes
    step = jax.jit(lambda w: w * 0 - 1, donate_argnums=0)
    step(_state()["w"])
    for number in (2, 4):
        state = _state(float(number))
        events.clear()
        checkpoints.save(number, state)
        assert sorted(what for what, _ in events if what == "copied") == ["copied", "copied"], (
            "save() returns once every array is on the host: the next step may donate it")
        state["w"] = step(state["w"])  # the loop's next step, donating the state
        checkpoints.wait()
        # 90 bytes at a time: w (256 bytes, alone) is written before b is copied, or the other way round
        in_flight = [sum(1 for e in events[:i + 1] if e[0] == "copied") - sum(1 for e in events[:i + 1]
                     if e[0] == "written") for i in range(len(events))]
        assert max(in_flight) == 1 and len(events) == 4, events
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint: a save's copy")]
    assert len(said) == 1 and "needs 272 B of host memory for the 1 process on this host" in said[0]
    for number in (2, 4):
        back = checkpoints.restore(number, _state())
        assert np.asarray(back["w"]).tobytes() == np.asarray(_state(float(number))["w"]).tobytes()
        assert np.asarray(back["b"]).tobytes() == np.full(4, number, np.float32).tobytes()
    checkpoints.close()


def test_the_processes_on_a_host_come_from_the_launcher_or_slurm_else_all_of_them() -> None:
    launcher = {"JOB_LAUNCH_COORDINATOR": "127.0.0.1:1234", "JOB_LAUNCH_NUM_PROCESSES": "4",
                "JOB_LAUNCH_PROCESS_ID": "1"}
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-3]", "SLURM_NTASKS": "6", "SLURM_PROCID": "3",
             "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}
    assert headroom.processes_on_host(launcher, 4) == 4
    assert headroom.processes_on_host(slurm, 6) == 2
    assert headroom.processes_on_host({k: v for k, v in slurm.items() if "TASKS_PER_NODE" not in k}, 6) == 6
    assert headroom.processes_on_host({}, 8) == 8  # nothing says: all of them may be on this host
    assert headroom.processes_on_host(launcher, 1) == 1


def test_a_cgroup_limit_caps_what_the_host_has_available(tmp_path: Path) -> None:
    meminfo = "MemTotal:       25165824 kB\nMemFree:         1048576 kB\nMemAvailable:    8388608 kB\n"
    assert host.mem_available(meminfo) == 8 * GIB
    assert host.mem_available("MemTotal: 25165824 kB\n") is None
    (tmp_path / "proc").write_text("0::/job/step\n")
    job, step = tmp_path / "cg" / "job", tmp_path / "cg" / "job" / "step"
    step.mkdir(parents=True)
    (job / "memory.max").write_text(f"{10 * GIB}\n")
    (job / "memory.current").write_text(f"{7 * GIB}\n")
    (job / "memory.stat").write_text(f"anon {6 * GIB}\ninactive_file {GIB}\n")
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text(f"{7 * GIB}\n")
    assert host.cgroup_room(tmp_path / "proc", tmp_path / "cg") == 4 * GIB  # 10 - 7 + 1 reclaimable
    (tmp_path / "proc").write_text("4:memory:/g\n")
    (tmp_path / "cg" / "memory" / "g").mkdir(parents=True)
    (tmp_path / "cg" / "memory" / "g" / "memory.stat").write_text("hierarchical_memory_limit 9223372036854771712\n")
    (tmp_path / "cg" / "memory" / "g" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    assert host.cgroup_room(tmp_path / "proc", tmp_path / "cg") is None  # v1 without a limit


def test_a_host_that_does_not_say_what_is_available_copies_at_once(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(host, "MEMINFO", tmp_path / "missing")
    assert host.host_available() is None
    assert headroom.weigh(64 * GIB, host.host_available(), 1).fits
