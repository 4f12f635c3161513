"""What a benchmark hands back (`Section`), and the Markdown page and plot made from them."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import platform
import socket
from pathlib import Path
from typing import Any

VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


@dataclasses.dataclass
class Section:
    """One benchmark's figures: a table, its headline figures and notes, and raw data (JSON-able)."""

    name: str
    title: str
    columns: list[str] = dataclasses.field(default_factory=list)
    rows: list[list[str]] = dataclasses.field(default_factory=list)
    headline: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (figure, value, goal)
    notes: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def table(self) -> str:
        return table(self.columns, self.rows) if self.columns else ""

    def markdown(self) -> str:
        parts = [f"## {self.title}", ""]
        if self.rows:
            parts += [self.table(), ""]
        parts += [f"- {note}" for note in self.notes]
        parts.append(f"- ran in {self.seconds:.0f} s")
        return "\n".join(parts) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Section:
        d = dict(d)
        d["headline"] = [tuple(h) for h in d.get("headline", [])]
        return cls(**d)


def table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return "? GiB"


def machine() -> str:
    return (f"{socket.gethostname()}: {os.cpu_count()} x {_cpu_model()}, {_memory_gib()} RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def versions() -> str:
    found = []
    for name in VERSIONED:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} absent")
    return ", ".join(found)


def page(sections: list[Section], *, total_s: float, command: str, plot: str | None,
         load: list[float] | None = None) -> str:
    """The whole RESULTS.md; `load`: the 1-minute load average at each benchmark's start, and the end."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [
        "# Benchmark results",
        "",
        f"- date: {now}",
        f"- machine: {machine()}",
        f"- versions: {versions()}",
        f"- command: `{command}` ({total_s / 60:.1f} min)",
    ]
    if load:
        head.append(f"- load average (1 min) at each benchmark's start, and at the end: "
                    f"{', '.join(f'{x:.1f}' for x in load)} on {os.cpu_count()} cores "
                    "(above the core count, other work was sharing the machine)")
    head += [
        "",
        "Every figure is a ratio against a baseline measured in the same run: the median of",
        "several repetitions, template and baseline repetitions interleaved (A B A B ...).",
        "The machine may be shared, so single figures are noisy; ratios are what to read.",
        "Benchmarks print figures; they assert nothing about speed.",
        "",
        "## Summary",
        "",
    ]
    summary = [[s.title.split(":")[0], figure, value, goal]
               for s in sections for figure, value, goal in s.headline]
    head += [table(["benchmark", "figure", "value", "goal"], summary), ""]
    if plot:
        head += [f"![launch time vs process count]({plot})", ""]
    return "\n".join(head) + "\n" + "\n".join(s.markdown() for s in sections)


def launch_plot(section: Section, path: Path) -> bool:
    """Launch time vs process count, template vs bare JAX; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    points = section.data["points"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    styles = {"template": ("tab:blue", "job.launch + job.initialize"),
              "bare": ("tab:orange", "Popen loop + jax.distributed.initialize")}
    for kind, (color, label) in styles.items():
        ns = [p["n"] for p in points]
        coll = [p[kind]["collective_s"] for p in points]
        exit_ = [p[kind]["exit_s"] for p in points]
        ax.plot(ns, coll, "o-", color=color, label=f"{label}: first collective")
        ax.plot(ns, exit_, "s--", color=color, alpha=0.6, label=f"{label}: exit")
    ax.set_xscale("log", base=2)
    ax.set_xticks([p["n"] for p in points], [str(p["n"]) for p in points])
    ax.set_xlabel("processes (1 CPU device each)")
    ax.set_ylabel("seconds from launch (median)")
    ax.set_title(f"Launch and init scaling on {os.cpu_count()} cores")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def standalone(argv: list[str], run: Any, worker: Any | None = None, child: Any | None = None) -> int:
    """A benchmark module's own command line.

    ``python -m bench.X [--quick]`` runs it and prints its section;
    ``python -m bench.X worker ...`` is the in-process part its parent starts;
    ``python -m bench.X child ...`` is one process of a cluster its parent launches.
    """
    import json
    import sys
    import time

    for name, entry in (("worker", worker), ("child", child)):
        if argv[:1] == [name] and entry is not None:
            entry(argv[1:])
            return 0
    began = time.perf_counter()
    section = run(quick="--quick" in argv)
    section.seconds = time.perf_counter() - began
    print(section.markdown())
    if "--json" in argv:
        json.dump(dataclasses.asdict(section), sys.stdout, indent=1)
    return 0
