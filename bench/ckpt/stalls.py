"""Where the loop's thread is when a step beside a write stalls: its frames sampled, gc's pauses, the GIL's waits.

    with Stalls() as stalls:
        spans = [timed step (start, end), ...]
    stalls.report(spans)     # for each step over STALL x the median: gc's seconds in it, the sampler's longest
                             # wait (a thread that sleeps SAMPLE_S and wakes much later waited for the GIL or a
                             # core), and the loop's innermost frames seen most often

A step that waits on its device shows the loop's thread in `block_until_ready`; one that waits for the GIL shows it
in Python code with the sampler late too; a collection shows up in gc's own callback.
"""

from __future__ import annotations

import collections
import gc
import statistics
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any

SAMPLE_S = 0.005  # how often the loop's thread is looked at
STALL = 2.0  # a step this many times the median is a stall
FRAMES = 4  # the innermost frames named per sample
LATE_S = 0.3  # a sampler this late looks at every thread: the one that held the GIL is likely still where it was


def where(frame: FrameType | None) -> str:
    """The innermost FRAMES frames as 'file:function:line < ...'."""
    names = []
    while frame is not None and len(names) < FRAMES:
        names.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(names)


class Stalls:
    """Samples the main thread's frames every SAMPLE_S on a thread of its own and hears gc's collections."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, str]] = []  # (time, seconds since the previous sample, where)
        self.collections: list[tuple[float, float, int]] = []  # (start, end, generation)
        self.late: list[tuple[float, float, dict[str, str]]] = []  # (time, wait, {thread name: where}) after LATE_S
        self._gc_began: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-stalls", daemon=True)

    def __enter__(self) -> Stalls:
        gc.callbacks.append(self._heard)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        gc.callbacks.remove(self._heard)

    def _heard(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_began = now
        elif self._gc_began is not None:
            self.collections.append((self._gc_began, now, int(info.get("generation", -1))))
            self._gc_began = None

    def _sample(self) -> None:
        main = threading.main_thread().ident
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(SAMPLE_S)
            now = time.perf_counter()
            frames = sys._current_frames()  # noqa: SLF001 - the one way to see another thread's stack
            self.samples.append((now, now - last, where(frames.get(main))))
            if now - last > LATE_S:
                names = {t.ident: t.name for t in threading.enumerate()}
                self.late.append((now, now - last, {names.get(i, str(i)): where(f) for i, f in frames.items()}))
            last = now

    def report(self, spans: list[tuple[float, float]]) -> dict[str, Any]:
        """The stalls among `spans` (each step's start and end): their seconds, gc's part, the sampler's longest
        wait in them, and the loop's commonest frames; and the same counts over every step, to compare."""
        if not spans:
            return {"stalls": []}
        median = statistics.median(end - start for start, end in spans)
        stalls = []
        for start, end in spans:
            if end - start < STALL * median:
                continue
            inside = [s for s in self.samples if start <= s[0] <= end]
            gc_s = sum(min(e, end) - max(b, start) for b, e, _ in self.collections if b < end and e > start)
            common = collections.Counter(s[2] for s in inside).most_common(3)
            stalls.append({"at_s": round(start - spans[0][0], 3), "seconds": round(end - start, 3),
                           "gc_s": round(gc_s, 3), "sampler_longest_wait_s": round(max((s[1] for s in inside),
                                                                                         default=0.0), 3),
                           "frames": [(w, n) for w, n in common]})
        everything = [s for s in self.samples if spans[0][0] <= s[0] <= spans[-1][1]]
        return {"median_step_s": round(median, 4), "stalls": stalls,
                "late": [{"at_s": round(t - spans[0][0], 3), "wait_s": round(w, 3), "threads": threads}
                         for t, w, threads in self.late],
                "gc_collections": len(self.collections), "gc_s": round(sum(e - b for b, e, _ in self.collections), 3),
                "sampler_waits_over_50ms": sum(1 for s in everything if s[1] > 0.05),
                "frames_overall": collections.Counter(s[2] for s in everything).most_common(3)}
