"""A real (single-process) Checkpointer: saves from its thread (when the copy fits), what it reads, its failure
message."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from job.runs import checkpoint, headroom
from job.runs.checkpoint import Checkpointer, CheckpointError
from job.runs.config import CheckpointConfig
from job.runtime import device_memory, host


def _state(offset: float = 0.0) -> dict:
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    return {"w": jax.device_put(np.arange(64.0, dtype=np.float32).reshape(16, 4) + offset, rows),
            "b": jax.device_put(np.full(4, offset, np.float32), NamedSharding(mesh, PartitionSpec())),
            "count": np.array(7), "name": "kept"}


def test_snapshot_copies_every_array_into_new_buffers_with_the_same_sharding() -> None:
    state = _state(1.0)
    copied = checkpoint.snapshot(state)
    for key in ("w", "b"):
        assert copied[key].sharding.is_equivalent_to(state[key].sharding, state[key].ndim)
        np.testing.assert_array_equal(np.asarray(copied[key]), np.asarray(state[key]))
        for mine, theirs in zip(copied[key].addressable_shards, state[key].addressable_shards, strict=True):
            assert mine.data.unsafe_buffer_pointer() != theirs.data.unsafe_buffer_pointer()
    assert copied["count"] is state["count"] and copied["name"] == "kept"


def test_snapshot_copies_arrays_on_different_devices_one_by_one() -> None:
    first, second = jax.devices()[:2]
    state = {"a": jax.device_put(jnp.arange(3.0), first), "b": jax.device_put(jnp.ones(2), second)}
    copied = checkpoint.snapshot(state)
    assert copied["a"].devices() == {first} and copied["b"].devices() == {second}
    assert copied["a"].unsafe_buffer_pointer() != state["a"].unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(copied["b"]), np.ones(2))


def test_a_background_save_keeps_the_state_of_its_step_while_the_loop_donates_it(tmp_path: Path) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    state = _state(5.0)
    step = jax.jit(lambda w: w * 0 - 1, donate_argnums=0)
    step(_state()["w"])  # compiled before: it runs the moment save returns
    checkpoints.save(3, state)
    state["w"] = step(state["w"])  # the next step overwrites the array in place while the save runs
    assert state["w"].sharding.is_equivalent_to(_state()["w"].sharding, 2)  # (in place: same layout)
    checkpoints.wait()
    back = checkpoints.restore(3, _state())
    np.testing.assert_array_equal(np.asarray(back["w"]), np.arange(64.0).reshape(16, 4) + 5.0)
    np.testing.assert_array_equal(np.asarray(back["b"]), np.full(4, 5.0))
    assert back["w"].sharding.is_equivalent_to(_state()["w"].sharding, 2)
    assert int(back["count"]) == 7
    checkpoints.close()


@pytest.mark.parametrize("background", [True, False])
def test_a_save_that_cannot_start_is_one_error_naming_the_step(background: bool, tmp_path: Path) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig(background=background))
    unsaveable = {"w": jnp.ones(3), "lock": threading.Lock()}  # orbax has no handler for a lock
    with pytest.raises(CheckpointError, match=r"^checkpoint: expected to write step 4 to .*ck, found ") as err:
        checkpoints.save(4, unsaveable)
        checkpoints.wait()  # in the background the error comes here, the thread having kept it
    assert "Complete checkpoints on disk: none" in str(err.value)
    checkpoints.close()


def test_the_write_runs_at_a_low_cpu_priority_and_the_loop_does_not(tmp_path: Path) -> None:
    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    for step in (1, 2):  # tensorstore's pool grows while it writes; the threads stay for the next save
        checkpoints.save(step, _state())
        checkpoints.wait()
    writers = [int(tid) for tid in os.listdir("/proc/self/task")
               if Path(f"/proc/self/task/{tid}/comm").read_text().strip() == checkpoint.WRITER_THREADS]
    assert writers, "tensorstore's threads wrote the arrays"
    for tid in writers:
        assert os.getpriority(os.PRIO_PROCESS, tid) >= checkpoint.WRITER_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice
    checkpoints.close()


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


class _Device:
    """A device whose backend reports its memory, as a GPU's or a TPU's does."""

    def __init__(self, limit: int, in_use: int) -> None:
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use, "peak_bytes_in_use": in_use}

    def memory_stats(self) -> dict[str, int]:
        return self.stats


def test_a_device_that_reports_its_memory_gets_the_copy_only_where_it_fits_with_headroom() -> None:
    roomy, tight = _Device(16 * GIB, 10 * GIB), _Device(16 * GIB, 13 * GIB)
    found = headroom.room([roomy, tight])
    assert found.devices == {roomy: 6 * GIB, tight: 3 * GIB}
    assert found.host is None  # every device says: the host is not asked
    assert headroom.fits({roomy: 2 * GIB, tight: 2 * GIB}, found) == headroom.Fit(True, 2 * GIB, 3 * GIB)
    no_room = headroom.fits({roomy: 3 * GIB, tight: 3 * GIB}, found)  # 3 GiB > 90% of the tight one's 3 GiB
    assert no_room == headroom.Fit(False, 3 * GIB, 3 * GIB) and no_room.where() == "per device"
    assert not headroom.fits({roomy: 7 * GIB}, found).fits  # more than the roomy device has


def test_the_copy_leaves_room_for_the_train_steps_program_to_load_again() -> None:
    """The chip's case (a user's model at batch 8, remat off): 14.0 GiB free between steps, a 1.7 GiB copy, and a
    step whose program reserves 13.8 GiB when it loads: the copy would leave it 12.3, so it is not made."""
    mib = 2**20
    device = _Device(16128 * mib, 1792 * mib)  # 15.75 GiB, 14.0 of it free
    between_steps = headroom.room([device])
    assert headroom.fits({device: 1741 * mib}, between_steps).fits  # what was asked before: it fitted
    beside = headroom.beside_program(between_steps, 14131 * mib)
    assert beside.devices == {device: 205 * mib}
    assert not headroom.fits({device: 1741 * mib}, beside).fits
    assert headroom.beside_program(headroom.Room({0: None}, GIB, 1), GIB).devices == {0: None}  # a CPU: as it is


def test_a_checkpointer_told_the_programs_size_writes_from_the_live_state_where_the_copy_would_crowd_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    checkpoints.room = lambda devices: headroom.Room({d: 14 * GIB for d in devices}, host=None, processes_on_host=1)
    checkpoints.reserved = 13 * GIB  # the step's program: 1 GiB is left for the copy
    caplog.set_level(logging.INFO, logger=checkpoint.__name__)
    checkpoints.save(1, _state(1.0))
    checkpoints.wait()
    checkpoints.reserved = 14 * GIB  # nothing left beside it
    checkpoints.save(2, _state(2.0))
    checkpoints.wait()
    said = _saved_way(caplog)
    assert said[0].startswith("checkpoint save 1: copied on the devices") and "1.0 GiB free" in said[0]
    assert said[1].startswith("checkpoint save 2: written from the live state") and "of the 0 B free" in said[1]
    np.testing.assert_array_equal(np.asarray(checkpoints.restore(2, _state())["w"]), np.asarray(_state(2.0)["w"]))
    checkpoints.close()


def test_cpu_devices_share_the_hosts_available_memory_with_every_process_on_it() -> None:
    meminfo = "MemTotal:       25165824 kB\nMemFree:         1048576 kB\nMemAvailable:    8388608 kB\n"
    assert host.mem_available(meminfo) == 8 * GIB
    assert host.mem_available("MemTotal: 25165824 kB\n") is None
    cpus = {0: GIB, 1: GIB}  # this process's copy: 1 GiB on each of its 2 devices
    four = headroom.fits(cpus, headroom.Room({0: None, 1: None}, 8 * GIB, processes_on_host=4))
    assert four == headroom.Fit(False, 8 * GIB, 8 * GIB, processes_on_host=4)
    assert four.where() == "on the host for its 4 processes"
    assert headroom.fits(cpus, headroom.Room({0: None, 1: None}, 8 * GIB, processes_on_host=3)).fits


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


def test_free_memory_that_nothing_reports_keeps_the_copy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert headroom.fits({0: 64 * GIB}, headroom.Room({0: None}, None, 1)) == headroom.Fit(True, 64 * GIB, None, 1)
    assert device_memory.free(jax.devices()[0]) is None  # XLA:CPU does not report
    monkeypatch.setattr(host, "MEMINFO", tmp_path / "missing")
    assert host.host_available() is None


def _saved_way(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint save ")]


def test_a_save_whose_copy_does_not_fit_is_written_from_the_live_state_and_restores_bitwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    copies, snapshot = [], checkpoint.snapshot
    monkeypatch.setattr(checkpoint, "snapshot", lambda tree: copies.append(tree) or snapshot(tree))
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    checkpoints.room = lambda devices: headroom.Room({d: None for d in devices}, host=100, processes_on_host=1)
    step = jax.jit(lambda w: w * 0 - 1, donate_argnums=0)
    step(_state()["w"])
    caplog.set_level(logging.INFO, logger=checkpoint.__name__)
    for number in (2, 4):
        state = _state(float(number))
        checkpoints.save(number, state)
        state["w"] = step(state["w"])  # the loop's next step, donating the state
        checkpoints.wait()
    assert copies == []
    # 8 devices x (32 bytes of w + 16 of b), more than 90% of 100 bytes: said once, at the first save
    assert _saved_way(caplog) == ["checkpoint save 2: written from the live state on the loop's thread (the "
                                  "on-device copy needs 384 B on the host for its 1 process, more than 90% of "
                                  "the 100 B free); the loop waits for it"]
    for number in (2, 4):
        back = checkpoints.restore(number, _state())
        assert np.asarray(back["w"]).tobytes() == np.asarray(_state(float(number))["w"]).tobytes()
        assert np.asarray(back["b"]).tobytes() == np.full(4, number, np.float32).tobytes()
    checkpoints.room = lambda devices: headroom.Room({d: None for d in devices}, host=GIB, processes_on_host=1)
    checkpoints.save(6, _state(6.0))
    checkpoints.wait()
    assert len(copies) == 1
    assert _saved_way(caplog)[1:] == ["checkpoint save 6: copied on the devices and saved from a thread, the "
                                      "loop goes on (the copy needs 384 B on the host for its 1 process, 1.0 GiB "
                                      "free)"]
    checkpoints.close()


def test_the_first_background_save_says_it_copies_even_when_nothing_reports_memory(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    checkpoints.room = lambda devices: headroom.Room({d: None for d in devices}, host=None, processes_on_host=1)
    caplog.set_level(logging.INFO, logger=checkpoint.__name__)
    for number in (1, 2):
        checkpoints.save(number, _state(float(number)))
        checkpoints.wait()
    assert _saved_way(caplog) == ["checkpoint save 1: copied on the devices and saved from a thread, the loop "
                                  "goes on (free memory is not reported here)"]
    np.testing.assert_array_equal(np.asarray(checkpoints.restore(2, _state())["w"]), np.asarray(_state(2.0)["w"]))
    checkpoints.close()



def test_the_log_line_names_the_process_without_room_and_its_numbers() -> None:
    rows = np.stack([headroom.Fit(True, GIB, 40 * GIB).row(), headroom.Fit(False, 3 * GIB, 2 * GIB).row(),
                     headroom.Fit(False, 5 * GIB, 4 * GIB, processes_on_host=4).row()])
    assert headroom.saved_way(100, False, rows) == (
        "checkpoint save 100: written from the live state on the loop's thread (process 1: the on-device copy "
        "needs 3.0 GiB per device, more than 90% of the 2.0 GiB free); the loop waits for it")
    assert headroom.saved_way(7, True, rows[:1]) == (
        "checkpoint save 7: copied on the devices and saved from a thread, the loop goes on (the copy needs "
        "1.0 GiB per device, 40.0 GiB free)")
