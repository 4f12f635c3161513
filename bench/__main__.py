"""Run the benchmarks; write bench/RESULTS.md and bench/launch_scaling.png.

    python -m bench                      # everything (~10-15 min on 2 cores); writes the results
    python -m bench --quick              # a fast smoke run (~5 min); prints, writes nothing
    python -m bench --only step,ckpt     # some of them; prints, writes nothing
    python -m bench --quick --out /tmp/r.md   # write anyway (the plot goes next to it)

Benchmarks: step, scaling, hostsync, ckpt, pipeline, mfu, growth, compile_cache, fingerprint, scale, records,
depth, tiers, recovery, experts, preemption (see bench/__init__.py); on a chip, by hand: ckpt.options,
ckpt.beside, tpu.
A partial or quick run writes files only with --out, so it never replaces
the full results. Exit status 1 when a benchmark failed to run (speed is never
asserted).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

from bench import BENCHMARKS
from bench.report import Section, launch_plot, page

HERE = Path(__file__).resolve().parent
PLOT = "launch_scaling.png"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and process counts (a smoke run)")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write the Markdown (default: bench/RESULTS.md for a full run, "
                        "nothing for --quick / --only)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}: expected some of {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    out = args.out or (None if (args.quick or args.only) else HERE / "RESULTS.md")
    began = time.perf_counter()
    sections: list[Section] = []
    failed = []
    load = []
    for name in names:
        load.append(os.getloadavg()[0])
        module = importlib.import_module(f"bench.{name}")
        print(f"==> {module.TITLE}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            section = module.run(quick=args.quick)
        except Exception as exc:  # noqa: BLE001 - report it, run the others
            traceback.print_exc()
            failed.append(name)
            section = Section(name, module.TITLE, headline=[(name, "failed to run", "")],
                              notes=[f"failed: {type(exc).__name__}: {str(exc)[:2000]}"])
        section.seconds = time.perf_counter() - start
        sections.append(section)
        print(section.markdown(), flush=True)
    total = time.perf_counter() - began
    load.append(os.getloadavg()[0])
    command = "python -m bench" + (" " + " ".join(sys.argv[1:] if argv is None else argv)).rstrip()
    plot = None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    scaling = next((s for s in sections if s.name == "scaling" and s.data.get("points")), None)
    if out is not None and scaling is not None:
        target = out.parent / PLOT
        if launch_plot(scaling, target):
            plot = PLOT
            print(f"wrote {target}", file=sys.stderr)
        else:
            print("matplotlib is not installed: no plot (pip install '.[bench]')", file=sys.stderr)
    text = page(sections, total_s=total, command=command.strip(), plot=plot, load=load)
    if out is not None:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    else:
        print("## Summary" + text.split("## Summary", 1)[1].split("\n## ", 1)[0])
    print(f"benchmarks took {total / 60:.1f} min" + (f"; failed: {', '.join(failed)}" if failed else ""),
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
