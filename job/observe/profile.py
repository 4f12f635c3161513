"""A `jax.profiler` trace of chosen training steps, one folder per host.

    python -m job train --profile.steps 10:15      # steps 10..15 -> RUN_DIR/profile/process-N/

The trace starts just before step A runs and stops once step B's results are
ready, so it holds exactly those steps; each is named in the trace by
`jax.profiler.StepTraceAnnotation("train", step_num=N)`. Every process writes
its own folder (hosts never share one). Open them with TensorBoard's profile
plugin or xprof (`xprof --logdir RUN_DIR/profile/process-0`), or load the
`*.trace.json.gz` file in https://ui.perfetto.dev.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
import jax
from etils import epath

from job.core import rundir, storage, values
from job.core.errors import as_config_error

log = logging.getLogger("job.train")

def parse_steps(text: str, total_steps: int) -> tuple[int, int]:
    """"A:B" -> (A, B): steps A..B, both included, 1 <= A <= B <= total_steps."""
    first_text, _, last_text = text.partition(":")
    with as_config_error(
        "--profile.steps", expected=f"A:B with 1 <= A <= B <= {total_steps} (--steps), both steps included",
        found=text, fix=f"pass --profile.steps {min(10, total_steps)}:{min(15, total_steps)}",
    ):  # spaces around either number are fine; the numbers are plain digits
        first = values.whole(first_text.strip(), minimum=1, maximum=total_steps)
        return first, values.whole(last_text.strip(), minimum=first, maximum=total_steps)


def trace_dir(run_dir: Path | epath.Path, process_index: int) -> Path | epath.Path:
    """Where `process_index` writes its trace: its own folder under RUN_DIR/profile."""
    return rundir.trace(run_dir, process_index)


class StepProfiler:
    """Call `step(n)` around each training step n (1-based); traces steps first..last when `steps` is given."""

    def __init__(self, steps: str, total_steps: int, run_dir: Path | epath.Path, process_index: int) -> None:
        self.range = parse_steps(steps, total_steps) if steps else None
        self.folder = trace_dir(run_dir, process_index)
        self.active = False
        self.seconds = 0.0  # spent starting, waiting for and ending the trace (the goodput's "profile" part)

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[list[object]]:
        """Wraps step `number`; the caller appends the step's outputs to the yielded list, which are
        waited for before the trace stops after the last step."""
        outputs: list[object] = []
        if self.range is None or not self.range[0] <= number <= self.range[1]:
            yield outputs
            return
        began = time.perf_counter()
        if not self.active:
            storage.make_dirs(self.folder)
            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
            self.active = True
            log.info("profiling steps %d..%d to %s", *self.range, self.folder)
        self.seconds += time.perf_counter() - began
        with jax.profiler.StepTraceAnnotation("train", step_num=number):
            yield outputs
            began = time.perf_counter()
            jax.block_until_ready(outputs)
        self.seconds += time.perf_counter() - began
        if number == self.range[1]:
            self.stop()

    def stop(self) -> None:
        """End the trace (at the last step, or when the loop ends early); a no-op when none runs."""
        if self.active:
            began = time.perf_counter()
            jax.profiler.stop_trace()
            self.active = False
            self.seconds += time.perf_counter() - began
            log.info("profile written to %s", self.folder)
