"""The GPU checks in one run, under 8 minutes on one H100/H200-class GPU; written to a Markdown file.

    bench/gpu.sh                          # on the GPU machine: bench/RESULTS-gpu.md
    bench/gpu.sh --cpu --out /tmp/g.md    # the same steps on CPU at toy sizes (the test of this file)

1. MFU of the GPT-2-small-sized LM (123.5M parameters in its matmuls), bf16, cuDNN attention
   through `jax.nn.dot_product_attention` (`python -m bench.mfu`; goal >= 45%).
2. The ~1B LM (dim 2048, 16 heads, 20 layers, mlp 8192, bf16 compute, remat) trained by
   `python -m job train --rule fsdp`: its state created as its shards on the GPU, 2 steps, saved,
   resumed for 2 more; each run's peak device memory (`memory_stats`) and peak RSS.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import ROOT, cpu_env, records

HERE = Path(__file__).resolve().parent
LM_1B = ("--model.vocab-size", "256", "--model.dim", "2048", "--model.heads", "16", "--model.layers", "20",
         "--model.mlp-dim", "8192", "--model.remat", "full", "--model.dtype", "bfloat16", "--data.global-batch", "8")
LM_TOY = ("--model.vocab-size", "64", "--model.dim", "64", "--model.heads", "4", "--model.layers", "2",
          "--model.mlp-dim", "128", "--model.remat", "full", "--data.global-batch", "4")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/gpu.sh", description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="toy sizes on CPU: checks the script, measures nothing")
    p.add_argument("--out", type=Path, default=HERE / "RESULTS-gpu.md", help="the Markdown to write")
    return p


def _env(cpu: bool) -> dict[str, str]:
    return cpu_env(1) if cpu else cpu_env(None, JAX_PLATFORMS="")


def _mfu(cpu: bool) -> str:
    from bench.report import Section

    # on CPU the steps only have to run: the tiny model at 2 sequences a step
    toy = ["--force", "--tiny", "--batch", "2"] if cpu else []
    argv = [sys.executable, "-m", "bench.mfu", "worker", "--quick", *toy]
    proc = subprocess.run(argv, cwd=ROOT, env=_env(cpu), capture_output=True, text=True, timeout=600, check=False)
    found = records(proc.stdout)
    if proc.returncode != 0 or not found:
        return f"## MFU\n\nfailed ({proc.returncode}):\n\n```\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}\n```\n"
    return Section.from_dict(found[-1]).markdown()


def _big(cpu: bool, root: Path) -> str:
    rows = []
    for label, steps in (("created sharded, 2 steps, saved", 2), ("resumed, 2 more steps", 4)):
        argv = [sys.executable, "-m", "bench.peak", "train", "--run-dir", str(root / "big"), "--steps", str(steps),
                "--rule", "fsdp", "--log-every", "1", "--data.eval-batches", "0", "--compile-cache", "none",
                *(LM_TOY if cpu else LM_1B)]
        began = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, env=_env(cpu), capture_output=True, text=True, timeout=900,
                              check=False)
        seconds = time.perf_counter() - began
        found = records(proc.stdout)
        if proc.returncode != 0 or not found:
            rows.append(f"| {label} | failed ({proc.returncode}) | | | |")
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            continue
        r = found[-1]
        device = r.get("device_peak_mib")
        rows.append(f"| {label} | {r['parameters']:,} | {f'{device:,.0f} MiB' if device else 'n/a'} | "
                    f"{r['peak_rss_mib']:,.0f} MiB | {seconds:.0f} s |")
    size = "toy LM (CPU check)" if cpu else "~1B LM, bf16 compute, remat, fsdp"
    return "\n".join([f"## The {size} on one device", "",
                      "| run | parameters | peak device memory | peak RSS | wall |", "|---|---|---|---|---|",
                      *rows, ""])


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    began = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    try:
        parts = ["# GPU results", "", f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
                 f"- command: `bench/gpu.sh{' --cpu' if args.cpu else ''}`", "", _mfu(args.cpu), _big(args.cpu, root)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    parts.append(f"- ran in {time.perf_counter() - began:.0f} s")
    args.out.write_text("\n".join(parts) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
