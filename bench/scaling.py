"""2. Launch and init scaling: `job.launch` + `job.initialize` vs a bare `jax.distributed.initialize`.

    python -m bench.scaling [--quick]

For each process count N (1 CPU device per process):

- template: ``python -m job.launch -n N --devices-per-process 1 -- python -m bench.scaling child template``;
  the child imports jax, calls `job.initialize()`;
- bare: a plain `subprocess.Popen` loop with a portpicker port; each child
  imports jax and calls ``jax.distributed.initialize(coordinator_address=...,
  num_processes=N, process_id=i)`` (not at N = 1, where a hand-written
  program would not call it either, and where `job.initialize` starts nothing).

Then both run one collective: a jitted sum over a global array that has one
element per process, checked against N(N+1)/2. Measured from just before the
first process is started: the time until every rank has finished that
collective, the time until every process (and the launcher) has exited, and
each process's peak RSS (`ru_maxrss`). Template and bare runs alternate.
"""

from __future__ import annotations

import math
import sys
import time

from bench.procs import ClusterRun, emit, launch_bare, launch_template
from bench.report import Section, standalone
from bench.timing import fmt_s, fmt_x, median

NAME = "scaling"
TITLE = "2. Launch and init scaling: job.launch + job.initialize vs bare jax.distributed"

# process count -> repetitions (each repetition = one template and one bare launch)
FULL = {1: 4, 2: 4, 4: 3, 8: 3, 16: 2, 32: 1}
QUICK = {1: 1, 2: 1, 4: 1}
CHILD = ["bench.scaling", "child"]


def child(argv: list[str]) -> None:
    """One rank: stamp the phases (time.time()), run one collective, report."""
    started = time.time()
    mode = argv[0]
    if mode == "template":
        import job

        import jax

        imported = time.time()
        info = job.initialize()
        n, rank = info.num_processes, info.process_id
    else:
        coordinator, n, rank = argv[1], int(argv[2]), int(argv[3])
        import jax

        imported = time.time()
        if n > 1:
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=rank)
    initialized = time.time()

    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from bench.procs import peak_rss_bytes

    mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(AxisType.Auto,))
    local = np.full((jax.local_device_count(),), rank + 1, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("d")), local)
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
    value = float(np.asarray(total.addressable_data(0)))
    collected = time.time()
    if value != n * (n + 1) / 2:
        raise SystemExit(f"rank {rank}: collective gave {value}, expected {n * (n + 1) / 2}")
    emit({"rank": rank, "n": n, "started": started, "imported": imported, "initialized": initialized,
          "collected": collected, "rss": peak_rss_bytes()})


def summarize(run: ClusterRun) -> dict[str, float]:
    """One launch: times from launch (s) and per-process peak RSS (bytes)."""
    r = run.ranks
    t0 = run.started
    return {
        "collective_s": max(x["collected"] for x in r) - t0,
        "exit_s": run.wall_s,
        "rss_median": median([x["rss"] for x in r]),
        "rss_max": max(x["rss"] for x in r),
        # phases, the slowest rank's
        "python_start_s": max(x["started"] for x in r) - t0,
        "import_s": max(x["imported"] - x["started"] for x in r),
        "init_s": max(x["initialized"] - x["imported"] for x in r),
        "collective_only_s": max(x["collected"] - x["initialized"] for x in r),
    }


def _fit(ns: list[int], ts: list[float]) -> tuple[float, float]:
    """(seconds per extra process by least squares, exponent of a power-law fit over n >= 2)."""
    mn, mt = sum(ns) / len(ns), sum(ts) / len(ts)
    den = sum((n - mn) ** 2 for n in ns)
    slope = sum((n - mn) * (t - mt) for n, t in zip(ns, ts)) / den if den else float("nan")
    pairs = [(math.log(n), math.log(t)) for n, t in zip(ns, ts) if n >= 2 and t > 0]
    if len(pairs) < 2:
        return slope, float("nan")
    lx, ly = sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs)
    den = sum((p[0] - lx) ** 2 for p in pairs)
    return slope, sum((p[0] - lx) * (p[1] - ly) for p in pairs) / den


def run(quick: bool = False) -> Section:
    plan = QUICK if quick else FULL
    points = []
    for n, reps in plan.items():
        runs: dict[str, list[dict[str, float]]] = {"template": [], "bare": []}
        for rep in range(reps):
            print(f"[bench scaling] {n} processes, repetition {rep + 1}/{reps}", file=sys.stderr, flush=True)
            runs["template"].append(summarize(launch_template(n, [*CHILD, "template"])))
            runs["bare"].append(summarize(launch_bare(n, [*CHILD, "bare"])))
        point: dict = {"n": n, "reps": reps}
        for kind, rs in runs.items():
            point[kind] = {key: median([r[key] for r in rs]) for key in rs[0]}
            point[kind]["runs"] = rs
        points.append(point)
    return section(points)


def section(points: list[dict]) -> Section:
    s = Section(NAME, TITLE, columns=[
        "processes", "reps", "to first collective: template", "bare", "ratio",
        "to exit: template", "bare", "ratio", "peak RSS / process: template", "bare",
    ], data={"points": points})
    for p in points:
        t, b = p["template"], p["bare"]
        s.rows.append([
            str(p["n"]), str(p["reps"]),
            fmt_s(t["collective_s"]), fmt_s(b["collective_s"]), fmt_x(t["collective_s"] / b["collective_s"]),
            fmt_s(t["exit_s"]), fmt_s(b["exit_s"]), fmt_x(t["exit_s"] / b["exit_s"]),
            f"{t['rss_median'] / 2**20:.0f} MiB", f"{b['rss_median'] / 2**20:.0f} MiB",
        ])
    ns = [p["n"] for p in points]
    fits = {}
    for kind in ("template", "bare"):
        fits[kind] = _fit(ns, [p[kind]["collective_s"] for p in points])
    s.data["fits"] = fits
    largest = points[-1]
    s.headline += [
        (f"launch to first collective, {largest['n']} processes, template / bare",
         fmt_x(largest["template"]["collective_s"] / largest["bare"]["collective_s"]), "~1.0"),
        (f"launch to exit, {largest['n']} processes, template / bare",
         fmt_x(largest["template"]["exit_s"] / largest["bare"]["exit_s"]), "~1.0"),
        ("peak RSS per process, template / bare (largest count)",
         fmt_x(largest["template"]["rss_median"] / largest["bare"]["rss_median"]), "~1.0"),
    ]
    s.notes.append(
        "Growth of the time to the first collective: template {:.2f} s, bare {:.2f} s per extra process "
        "(least squares); power-law exponent over n >= 2: template {:.2f}, bare {:.2f} "
        "(1.0 = linear, the expectation when N processes share {} cores).".format(
            fits["template"][0], fits["bare"][0], fits["template"][1], fits["bare"][1], _cores()))
    for kind in ("template", "bare"):
        x = largest[kind]
        s.notes.append(
            f"Where the time goes at {largest['n']} processes ({kind}, slowest rank, median): last process "
            f"started its script at {fmt_s(x['python_start_s'])}, imports {fmt_s(x['import_s'])}, "
            f"distributed init {fmt_s(x['init_s'])}, first collective (incl. compile) "
            f"{fmt_s(x['collective_only_s'])}; exit (shutdown barrier) {fmt_s(x['exit_s'] - x['collective_s'])} "
            "after the collective.")
    s.notes.append("The template's times include starting the launcher itself (`python -m job.launch`, "
                   "a Python interpreter) and its output pumping; the bare launcher is a loop inside the "
                   "already running benchmark process. RSS is the median over ranks of ru_maxrss.")
    return s


def _cores() -> int:
    import os

    return os.cpu_count() or 1


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, child=child))
