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


def test_lower_named_reaches_only_the_threads_of_that_name() -> None:
    before = _nice()
    named_ready, others_ready, done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def wait_then_report(key: str, ready: threading.Event) -> None:
        # the kernel's thread name (comm) is what lower_named reads: set it as a native thread would
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as fh:
            fh.write(key)
        ready.set()
        done.wait(10)
        seen[key] = _nice()

    threads = [threading.Thread(target=wait_then_report, args=("jobtest-writer", named_ready)),
               threading.Thread(target=wait_then_report, args=("jobtest-other", others_ready))]
    for thread in threads:
        thread.start()
    assert named_ready.wait(10) and others_ready.wait(10)
    priority.lower_named("jobtest-writer", before + 7)
    done.set()
    for thread in threads:
        thread.join()
    assert seen == {"jobtest-writer": before + 7, "jobtest-other": before}
    assert _nice() == before
