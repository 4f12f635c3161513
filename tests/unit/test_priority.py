"""job.runtime.priority on real threads: nice values only ever go up, and only where asked."""

from __future__ import annotations

import os
import threading

from job.runtime import priority


def _in_thread(fn) -> list:  # noqa: ANN001
    """Run fn in a new thread (so that the test process keeps its own nice value); what it returned."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_lower_raises_the_calling_threads_nice_value_and_never_lowers_it() -> None:
    before = _nice()

    def probe() -> list[int]:
        priority.lower(before + 5)
        first = _nice()
        priority.lower(before + 2)  # lower would need privileges, and is not what was asked
        return [first, _nice()]

    assert _in_thread(probe) == [[before + 5, before + 5]]
    assert _nice() == before


def _named_thread(name: str, ready: threading.Event, done: threading.Event, seen: dict[str, int]) -> threading.Thread:
    """A thread that names itself `name` in the kernel (as a native pool's thread does), then waits for `done` and
    reports its nice value under `name`."""

    def run() -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as fh:
            fh.write(name)
        ready.set()
        done.wait(10)
        seen[name] = _nice()

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(10)
    return thread


def test_named_lowering_reads_each_threads_name_once_and_reaches_the_ones_started_since(monkeypatch) -> None:  # noqa: ANN001
    before = _nice()
    done, seen = threading.Event(), {}
    first = _named_thread("jobtest-pool", threading.Event(), done, seen)
    other = _named_thread("jobtest-else", threading.Event(), done, seen)
    lowering = priority.NamedLowering("jobtest-pool", before + 6)
    read: list[int] = []
    comm = priority._comm  # noqa: SLF001 - counted, not replaced
    monkeypatch.setattr(priority, "_comm", lambda tid: read.append(tid) or comm(tid))
    assert lowering() == [first.native_id]
    assert first.native_id in read and other.native_id in read
    read.clear()
    later = threading.Thread(target=lambda: None)  # joined: gone before the next look
    later.start()
    later.join()
    second_done = threading.Event()
    second = _named_thread("jobtest-pool2", threading.Event(), second_done, seen)
    assert lowering() == []  # a name of its own: not lowered
    assert first.native_id not in read and other.native_id not in read, "a thread's name is read once"
    assert second.native_id in read
    done.set()
    second_done.set()
    for thread in (first, other, second):
        thread.join()
    assert seen == {"jobtest-pool": before + 6, "jobtest-else": before, "jobtest-pool2": before}


def test_named_lowering_looks_again_at_a_thread_not_named_yet() -> None:
    before = _nice()
    named, done, seen = threading.Event(), threading.Event(), {}
    go = threading.Event()

    def run() -> None:  # started under the process's own name; names itself only later, as a pool's thread may
        named.set()
        go.wait(10)
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as fh:
            fh.write("jobtest-late")
        done.wait(10)
        seen["late"] = _nice()

    thread = threading.Thread(target=run)
    thread.start()
    assert named.wait(10)
    lowering = priority.NamedLowering("jobtest-late", before + 4)
    assert lowering() == []
    go.set()
    for _ in range(100):  # until it has named itself
        if priority._comm(thread.native_id) == "jobtest-late":  # noqa: SLF001
            break
        threading.Event().wait(0.01)
    assert lowering() == [thread.native_id]
    done.set()
    thread.join()
    assert seen == {"late": before + 4}
