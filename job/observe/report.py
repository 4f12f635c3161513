"""Progress output and metrics. Process 0 writes; on the others every call is a no-op.

On a terminal: a tqdm progress bar. Otherwise: one concise line every
`log_every` steps. Always: metrics as JSON lines in `<run_dir>/metrics.jsonl`
and TensorBoard event files in `<run_dir>`; W&B too with `--wandb.project`
(the writers are in job/observe/metrics.py).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from etils import epath
from tqdm import tqdm

from job.core import rundir
from job.observe.metrics import WandbConfig, open_writers
from job.observe.stragglers import Straggler
from job.parallel.multihost import only_specific_processes

log = logging.getLogger("job.train")


class Reporter:
    """Writes every metric; the progress line shows the task's `shown` metrics and its throughput."""

    def __init__(self, run_dir: epath.Path, *, start_step: int, total_steps: int, items_per_step: int,
                 shown: Sequence[str] = ("loss",), unit: str = "samples", wandb: WandbConfig | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self._wandb, self._config = wandb, config
        self.items_per_step = items_per_step
        self.shown = tuple(shown)
        self.unit = unit
        self.total_steps = total_steps
        self._last_time = time.perf_counter()
        self._last_step = start_step
        self._bar = None
        self._open(start_step)

    @only_specific_processes()
    def _open(self, start_step: int) -> None:
        self._writers = open_writers(self.run_dir, start_step=start_step, wandb=self._wandb, config=self._config)
        if sys.stdout.isatty():
            self._bar = tqdm(total=self.total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _write(self, step: int, split: str, values: dict[str, float]) -> None:
        for writer in self._writers:
            writer.scalars(step, split, values)

    @only_specific_processes()
    def train(self, step: int, metrics: dict[str, float], lr: float) -> None:
        now = time.perf_counter()
        steps = max(step - self._last_step, 1)
        step_time = (now - self._last_time) / steps
        self._last_time, self._last_step = now, step
        rate = self.items_per_step / step_time if step_time > 0 else 0.0
        self._write(step, "train", {**metrics, "lr": lr, "step_time_s": step_time, f"{self.unit}_per_s": rate})
        if self._bar is not None:
            self._bar.update(steps)
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{lr:.2e}")
        else:
            log.info("step %d/%d  %s  lr %.2e  %.0f %s/s  %.1f ms/step", step, self.total_steps,
                     self._shown(metrics), lr, rate, self.unit, step_time * 1e3)

    @only_specific_processes()
    def checkpoint(self, step: int, blocked_s: float) -> None:
        """A save of `step` that held the loop `blocked_s` (the copy to host memory; the write runs on): recorded
        under the split "checkpoint" and left out of the next logged step's time, which times the steps alone."""
        self._last_time += blocked_s
        self._write(step, "checkpoint", {"blocked_s": blocked_s})

    @only_specific_processes()
    def hosts(self, step: int, stragglers: Sequence[Straggler]) -> None:
        """The stragglers of this log interval (job.observe.stragglers): one line naming each, and the metrics."""
        if not stragglers:
            return
        slowest = stragglers[0]
        self._write(step, "hosts", {"stragglers": float(len(stragglers)), "slowest_process": float(slowest.process),
                                    "slowest_host_ms": slowest.host_ms, "slowest_ratio": slowest.ratio})
        log.info("stragglers at step %d: %s", step, "; ".join(s.line() for s in stragglers))

    @only_specific_processes()
    def eval(self, step: int, metrics: dict[str, float], split: str = "eval") -> None:
        """One eval split's metrics, recorded under the split's name."""
        self._write(step, split, metrics)
        log.info("eval at step %d%s  %s", step, "" if split == "eval" else f" on {split}", self._shown(metrics))

    def _shown(self, metrics: dict[str, float]) -> str:
        names = (*self.shown, *(f"ema_{name}" for name in self.shown))  # an EMA's evaluation beside the model's
        return "  ".join(f"{name} {metrics[name]:.4f}" for name in names if name in metrics)

    @only_specific_processes()
    def message(self, text: str, *args: object) -> None:
        log.info(text, *args)

    @only_specific_processes()
    def flush(self) -> None:
        """Write out what the writers hold (in gs:// they batch): the loop calls it however it ends."""
        for writer in self._writers:
            writer.flush()

    @only_specific_processes()
    def close(self, summary: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.close()
        for writer in self._writers:
            writer.close()
        rundir.summary(self.run_dir).write_text(json.dumps(summary, indent=2) + "\n")
        log.info("done: %s", ", ".join(f"{k} {v}" for k, v in summary.items() if k not in ("params_sha256", "goodput")))
