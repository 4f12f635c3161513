"""Checkpoints: orbax's CheckpointManager, atomic, async, keep-last-N, on a disk or in gs://.

Orbax writes each step into a temporary folder and renames it only when
every process has finished, so an interrupted save is never listed (and
never restored). In Cloud Storage (no rename there) it writes the step in
place and adds a `commit_success.txt` object last; a step without it is
never listed either. Restoring takes abstract targets carrying the *current*
shardings, so a run saved on 4 processes x 2 devices resumes on any other
topology.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.type_handlers import (
    create_type_handler_registry,
    get_type_handler,
    supported_types,
)

from job.core import internals, storage
from job.core.errors import ConfigError, JobError
from job.parallel.multihost import (
    barrier,
    coordination_client,
    on_process_zero,
    only_specific_processes,
)
from job.parallel.trees import leaf_specs
from job.runs import headroom
from job.runs.array_io import ArrayReader
from job.runs.config import CheckpointConfig
from job.runtime import priority

log = logging.getLogger(__name__)

# What a failed write usually is; named first in the error (orbax buries it in long messages).
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO)
# Where a process that failed to write posts why (coordination service), for the others to raise too.
FAILED_KEY = "job/checkpoint/failed/"
POLL_S = 0.05  # how often wait() looks at this process's save
PEER_POLL_S = 1.0  # how often wait() asks the coordinator whether another process's save failed
WRITER_NICE = 19  # the save's threads give way to the loop's, the input's and the step's for CPU time
WRITER_THREADS = internals.TENSORSTORE_WRITER_THREADS  # tensorstore's pool, which copies and writes the arrays
ORBAX_COMMIT_THREAD = "async_save"  # orbax-checkpoint 0.12.8: its thread that waits for the write and commits it
SET_ASIDE = ".unreadable-"  # STEP.unreadable-TIME: a step that did not read back, moved aside and kept


class CheckpointError(JobError, RuntimeError):
    """A save failed (disk full, permissions, a vanished filesystem): says which step and what is safe."""


def abstract(tree: Any) -> Any:
    """Shape, dtype and sharding of every array leaf: what restore fills in."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        tree,
    )


def saved_steps(directory: epath.Path) -> list[int]:
    """The complete steps a checkpoints folder holds, in order, from its listing: folders named by their step (a
    save under way has another name), on gs:// only those with their commit marker. Raises what the listing
    raises (a vanished disk, a refused bucket)."""
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    if storage.is_remote(directory):  # a gs:// step is complete once its marker is there
        steps = [s for s in steps if (directory / str(s) / storage.COMMIT_MARKER).exists()]
    return steps


class Checkpointer:
    """Saves and restores the train state; `save` holds the loop for the copy of the state to host memory.

    A save copies this process's shards straight from the live arrays to host memory (orbax's
    `copy_to_host_async`, then one wait): no copy is made on the devices, so a save holds no device
    memory, and the next step may donate the state the moment `save` returns. The write then runs on
    orbax's and tensorstore's threads from host memory (async); where the devices are this host's CPU, at
    a low CPU priority (nice WRITER_NICE), so that they fill the gaps the step leaves instead of slowing it. Orbax's
    barriers go through the coordination service (every process is named), never device collectives.

    What a save needs of the host (its copy, for every process of the run on this host) is weighed
    once, from the state's plan (`like`), by job.runs.headroom: where it does not fit the host's
    available memory, the copies go in bounded batches, each written before the next is copied (the loop
    waits until the last is copied).
    """

    def __init__(self, directory: str | os.PathLike[str], cfg: CheckpointConfig, *, training: bool = False,
                 like: Any = None) -> None:
        """`training`: the run that writes here, which removes what an interrupted save left on a disk
        (orbax's N.orbax-checkpoint-tmp folders: a second Ctrl-C, a kill during a save; in a bucket orbax
        never restores them either); a reader (eval, export) never does, as the run it reads may be saving
        right now. `like`: the state a save writes (arrays or their abstract shapes with shardings), whose
        host copy is weighed against the host's memory; None: not weighed (a reader)."""
        path = storage.run_path(directory)
        self.directory = path if storage.is_remote(path) else path.absolute()
        processes = jax.process_count()
        self.options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            enable_background_delete=True,  # the keep-N deletion runs on orbax's thread, not the loop's
            # naming every process makes orbax's barriers coordination-service barriers (it uses device
            # collectives otherwise); orbax then leaves creating the folder to us
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                active_processes=set(range(processes)) if processes > 1 else None),
            create=processes == 1,
            # on a disk only: in a bucket orbax takes any step folder without its commit marker for one, and
            # a checkpoint set aside as unreadable is moved marker first (storage.move_aside)
            cleanup_tmp_directories=training and not storage.is_remote(path),
        )
        if processes > 1:
            on_process_zero(storage.make_dirs, self.directory)
            barrier(f"checkpoint folder {self.directory}")
        # the host copy's weight: None where it fits at once (or nothing says), else orbax's batch bound in GB
        self.host = None if like is None else headroom.host_fit(like)
        if self.host is not None and not self.host.fits:
            _say(self.host.line())
        self._writing: int | None = None  # the step an async save may still be writing
        self._failure: BaseException | None = None  # why this process's last write failed, the moment it did
        self._lowering: threading.Thread | None = None  # the thread lowering the write's threads' priority
        self._pool = priority.NamedLowering(WRITER_THREADS, WRITER_NICE)  # tensorstore's, each thread looked at once
        # the write's threads give way to the step only where the step computes on this host's cores (CPU devices):
        # on a TPU VM lowering them gained nothing in the real loop (bench.ckpt.loop: no-scan), and finding them
        # reads every thread's name in /proc, 0.7-1.1 s of a thread's time there
        self._host_computes = jax.local_devices()[0].platform == "cpu"
        self._listener = _FailureListener(self._write_failed)
        logging.getLogger("absl").addHandler(self._listener)  # orbax logs through absl
        self._transfers = _Transfers(batched=self.host is not None and not self.host.fits)
        self.manager = self._manager()

    def _manager(self) -> ocp.CheckpointManager:
        """A manager whose arrays are written by one replica each, copied to host in one piece.

        orbax's default on CPU and TPU splits every replicated array into per-replica slices,
        one eager slice per replica and array, on the loop's thread; that doubled the time a
        save blocked the loop (bench.ckpt). One replica per array is orbax's GPU default.
        Arrays are written with orbax's zstd where the devices are accelerators, and without it on CPU devices,
        each measured in `python -m job train` itself (bench.ckpt.loop): on a TPU VM the uncompressed write
        stalled a step beside it by 1.1-1.7 s at nearly every save (6 runs), the compressed one by 0.5 s at most,
        in about the same write time; on CPU devices zstd's threads took the step's cores (on a 2-core machine the
        steps beside the writes lost 9.6-12.3 s against 2.5-7.2 s, two runs each). Either format restores.
        Restores read through job.runs.array_io (files mapped into memory, shards into unfilled buffers). Each
        array's orbax metadata is written as orbax's default handler writes it (plain orbax then restores typed keys).
        Where the host copy does not fit at once (`self.host`), orbax copies in batches of `batch_gb` (`_Transfers`).
        """
        others = [(ty, get_type_handler(ty)) for ty in supported_types() if ty is not jax.Array]
        arrays = ArrayReader(use_replica_parallel=False, array_metadata_store=internals.orbax_array_metadata_store(),
                             callback=self._transfers)
        registry = create_type_handler_registry((jax.Array, arrays), *others)
        batches = None if self.host is None or self.host.fits else self.host.batch_gb()
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=not self._host_computes,
                                              save_device_host_concurrent_gb=batches)
        return ocp.CheckpointManager(self.directory, options=self.options, item_handlers=handler)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any) -> None:
        """Save `state` as `step` (collective): returns once this process's shards are in host memory, the write
        going on in the background when async. The next step may donate `state` at once."""
        barrier(f"checkpoint save {step}")  # a dead peer is a named timeout here, not orbax's barrier's long wait
        self.wait()  # orbax waits for the previous save anyway; a failure there is reported as that step's
        self._writing = step
        self._transfers.begin()
        try:
            self.manager.save(step, args=ocp.args.PyTreeSave(state), force=True)
            # in batches, the copies go on behind save(): the state is the loop's again once the last one is made
            self._transfers.wait(state, ended=lambda: self._failure is not None
                                 or not self.manager.is_saving_in_progress())
        except Exception as exc:
            raise self._failed(step, exc) from exc
        if self.options.enable_async_checkpointing:  # orbax's commit thread and tensorstore's, now writing
            self._lower_writers()

    def _lower_writers(self) -> None:
        """The write's threads (orbax's commit thread, tensorstore's pool) at nice WRITER_NICE, lowered on a thread of
        its own: reading thread names in /proc took 0.7-1.1 s on a TPU VM (a gVisor sandbox), which the loop must
        not wait for. Each of tensorstore's threads is looked at once (`priority.NamedLowering`): a save after the
        first reads the names of the threads started since only. Orbax's commit thread, new at every save, is found
        by its Python name. Only where the step computes on this host's cores (`_host_computes`)."""
        if not self._host_computes:
            return

        def lower() -> None:
            for thread in threading.enumerate():
                if thread.name == ORBAX_COMMIT_THREAD and thread.native_id is not None:
                    priority.lower(WRITER_NICE, thread.native_id)
            self._pool()

        self._lowering = threading.Thread(target=lower, name="job-checkpoint-nice", daemon=True)
        self._lowering.start()

    def writing(self) -> bool:
        """Whether this process's last save is still being written (`wait` returns once it is not)."""
        return self._failure is None and self.manager.is_saving_in_progress()

    def restore(self, step: int, like: Any, *, partial: bool = False) -> Any:
        """The saved state, placed like `like` (which may come from another topology); with `partial`,
        only the parts of it that `like` has (e.g. {"model": ...} without the optimizer)."""
        barrier(f"checkpoint restore {step}")
        target = abstract(like)
        return self.manager.restore(step, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=partial))

    def saved_step(self, step: int | None) -> int:
        """`step` if it was saved, the newest saved step for None; else one ConfigError naming them."""
        steps = self.all_steps()
        if step is None and steps:
            return max(steps)
        if step not in steps:
            raise ConfigError("--step", expected=f"a saved step of {self.directory.parent}: {steps or 'none saved'}",
                              found=step, fix=f"pass one of {steps}" if steps else "train the run first")
        return step

    def newest_specs(self) -> tuple[int, dict[str, tuple]] | None:
        """(step, {leaf path: (shape, dtype)}) of the newest step whose tree metadata reads, else None.

        Read before anything is restored, to tell a state this run does not build (bad input,
        job.runs.resume) from a damaged checkpoint (set aside by restore_newest)."""
        for step in sorted(self.all_steps(), reverse=True):
            try:
                return step, leaf_specs(self.manager.item_metadata(step))
            except Exception as exc:  # noqa: BLE001 - unreadable metadata: restore_newest sets the step aside
                log.warning("checkpoint step %d in %s: its tree metadata does not read (%s)", step,
                            self.directory, _first_line(exc))
        return None

    def restore_newest(self, like: Any) -> tuple[int, Any]:
        """The newest checkpoint that reads back; an unreadable one is reported and skipped."""
        steps = sorted(self.all_steps(), reverse=True)
        for step in steps:
            try:
                return step, self.restore(step, like)
            except Exception as exc:  # noqa: BLE001 - any read failure means: try the previous one
                log.warning("checkpoint step %d in %s is unreadable (%s); trying an older one",
                            step, self.directory, _first_line(exc))
                self._quarantine(step)
                # a failed read can leave the manager unusable: start a fresh one
                self.manager = self._manager()
        raise ConfigError(
            "checkpoints", expected="at least one readable checkpoint", found=f"steps {steps} all unreadable",
            fix=f"move {self.directory} aside to start afresh, or pass --no-resume",
        )

    def _quarantine(self, step: int) -> None:
        """Move an unreadable step aside (kept for inspection, never listed again).
        In gs:// its commit marker is deleted first, then its objects are copied and deleted."""
        on_process_zero(_set_aside, self.directory / str(step), step)
        barrier(f"checkpoint quarantine {step}")  # a dead peer here is a named timeout, not a hang
        storage.forget_listings(self.directory)  # the others listed the step before it moved

    def wait(self) -> None:
        """Block until the last save is on disk; CheckpointError if it failed on any process.

        A write that fails on some processes only (one host's disk, one replica writing an
        array) leaves orbax's own wait hanging: the failed process skips the barrier the
        others wait in, until orbax's 10-minute timeout. So this polls: a failure here is
        raised at once and posted for the others, who raise it at their next look.
        """
        peer_check = time.monotonic()
        try:
            while self.writing():
                if time.monotonic() - peer_check >= PEER_POLL_S:
                    peer_check = time.monotonic()
                    posted = _posted_failures()
                    if posted:
                        raise CheckpointError(f"{posted[0]} (reported by that process; this is process "
                                              f"{jax.process_index()})")
                time.sleep(POLL_S)
            if self._failure is not None:
                raise self._failure
            self.manager.wait_until_finished()
            if self._writing is not None:  # those tensorstore added while writing
                self._lower_writers()
        except CheckpointError:
            raise
        except Exception as exc:
            raise self._failed(self._writing, exc) from exc
        self._writing = None

    def _write_failed(self, exc: BaseException) -> None:
        """Called on orbax's thread the moment a write of this process fails: kept for wait(), and
        posted for the other processes (whose own writes may have worked)."""
        self._failure = exc
        _post_failure(str(self._failed(self._writing, exc)))

    def _failed(self, step: int | None, exc: BaseException) -> CheckpointError:
        """One message: which save failed and why, and what is still safe on disk."""
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        text = str(cause).splitlines()[0] if str(cause) else ""
        known = [os.strerror(code) for code in _STORAGE_ERRNOS if os.strerror(code) in text]
        reason = f"{known[0] + ' (' if known else ''}{type(cause).__name__}: {text[:200]}{')' if known else ''}"
        try:
            safe = saved_steps(self.directory)
            on_disk = f"{safe or 'none'} ({f'a rerun resumes from step {safe[-1]}' if safe else 'none complete yet'})"
        except Exception as err:  # noqa: BLE001 - a vanished disk, a refused bucket: the listing is unknown
            on_disk = f"unknown (cannot list the folder: {getattr(err, 'strerror', None) or err})"
        return CheckpointError(
            f"checkpoint: expected to write step {step} to {self.directory}, found {reason}. "
            f"Complete checkpoints on disk: {on_disk}. "
            f"Fix: free space in (or restore write access to) {self.directory}, or pass another --run-dir "
            "with the checkpoints copied over; then rerun"
        )

    def close(self) -> None:
        try:
            self.manager.close()
        finally:
            logging.getLogger("absl").removeHandler(self._listener)


class _Transfers:
    """orbax's ArrayHandler callback (a `SerializationStatusCallback`): how each array's copy to the host is scheduled,
    and how many have been made in the save under way.

    orbax's own default marks every array SYNCHRONOUS: save() copies them all at once, and its bound on the copies
    in flight (`save_device_host_concurrent_gb`) reaches none of them. Where the host cannot hold a save's copy at
    once (`batched`, job.runs.headroom), every array is ASYNCHRONOUS_DEPRIORITIZED instead: orbax copies them in
    batches within its bound, each batch written before the next is copied, and save() waits (`wait`) for the
    last copy, since the next step may donate the state. Called on orbax's threads."""

    def __init__(self, *, batched: bool) -> None:
        self.batched = batched
        self._copied = 0
        self._changed = threading.Condition()

    def key_priority(self, keypath: Any) -> Any:
        return internals.orbax_transfer_priority("ASYNCHRONOUS_DEPRIORITIZED" if self.batched else "SYNCHRONOUS")

    def begin(self) -> None:
        with self._changed:
            self._copied = 0

    def on_transfer_start(self, keypath: Any) -> None:
        pass

    def on_transfer_end(self, keypath: Any) -> None:
        with self._changed:
            self._copied += 1
            self._changed.notify_all()

    def on_write_start(self, keypath: Any) -> None:
        pass

    def on_write_end(self, keypath: Any) -> None:
        pass

    def wait(self, state: Any, ended: Callable[[], bool]) -> None:
        """Until every array of `state` is copied (at once unless batched), or the save `ended` without them (a
        failure, which `Checkpointer.wait` raises)."""
        if not self.batched:
            return
        arrays = sum(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))
        with self._changed:
            while self._copied < arrays and not ended():
                self._changed.wait(POLL_S)


def _first_line(exc: BaseException) -> str:
    """"Type: the first 200 characters of its message's first line" (orbax's messages run long)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


@only_specific_processes()
def _say(message: str) -> None:
    log.info("%s", message)


def _set_aside(source: epath.Path, step: int) -> None:
    """Move the unreadable step folder `source` aside, if it is there (process 0's part of `_quarantine`)."""
    if source.exists():
        target = source.with_name(f"{step}{SET_ASIDE}{int(time.time())}")
        storage.move_aside(source, target)
        log.warning("moved the unreadable checkpoint to %s", target)


class _FailureListener(logging.Handler):
    """Hears orbax's background save thread log its failure, with the exception: the one signal orbax
    gives at that moment (it raises the error only after barriers the other processes, whose writes
    worked, are waiting in elsewhere)."""

    def __init__(self, report: Callable[[BaseException], None]) -> None:
        super().__init__(logging.ERROR)
        self._report = report

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        caught = exc.__traceback__.tb_frame.f_code if exc is not None and exc.__traceback__ else None
        # the frame that caught it: orbax's background save thread (its logger may not name it)
        if exc is not None and caught is not None and internals.is_orbax_save_thread(caught):
            self._report(exc)


def _post_failure(message: str) -> None:
    """Tell the other processes that this one could not write (best effort: the error is raised anyway)."""
    client = coordination_client()
    if client is not None:
        try:
            client.key_value_set(f"{FAILED_KEY}{jax.process_index()}", f"process {jax.process_index()}: {message}",
                                 allow_overwrite=True)
        except Exception as exc:  # noqa: BLE001 - a coordinator that is gone: the others see this process exit
            log.warning("could not tell the other processes that the save failed: %s", exc)


def _posted_failures() -> list[str]:
    """What other processes posted about their failed writes (empty when none did)."""
    client = coordination_client()
    if client is None:
        return []
    return [value for _, value in sorted(client.key_value_dir_get(FAILED_KEY))]
