"""A real (single-process) Checkpointer: saves from its thread, what it reads, its failure message."""

from __future__ import annotations

import errno
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

from job.runs import checkpoint
from job.runs.checkpoint import Checkpointer, CheckpointError
from job.train.config import CheckpointConfig


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
