"""On a TPU VM: the example LM on the chip, measured, written to bench/RESULTS-tpu.md in one command.

    python -m bench.tpu [--out bench/RESULTS-tpu.md] [--corpus DIR] [--budget-s 3600] [--text-steps 1000]

Runs, one after another, each in its own process (a chip is held by one program at a time):

1. `python -m job train --preset gpt2-small`, the preset as a user runs it (no other flag): its own
   synthetic task, 1,000 steps; the loop's tokens/s as MFU, and the accuracy on the reversed positions;
2. `python -m bench.mfu worker --size gpt2-small`: the template's train step against a hand-written
   `jax.jit` step of the same model, interleaved;
3. the preset on real text, `--data.source CORPUS/stdlib.npy` (`python -m bench.corpus CORPUS` makes it
   offline, and this step runs it first where CORPUS has none: the Python standard library's sources through a
   byte-level BPE; it needs the `tokenizers` extra);
4. a ~400M configuration (dim 1024, 24 layers) through the loop, the preset's global batch of 16 as two
   micro-batches of 8 (`--accum-steps 2`, for which remat auto keeps the projections: dots), attention auto;
   `mfu400m`: its template step against the hand-written one (remat auto at batch 16: full); `400m-explicit`: the
   same command with the policy auto chose passed (`--model.remat`), whose time to the first step is auto's baseline
   (every run's time to the first step: summary.json's start-up and compile seconds);
5. `python -m bench.ckpt worker --size gpt2-small`: the checkpoint of gpt2-small's train state (2.6 GB with its
   AdamW state) from HBM: the time the loop is blocked, the whole save against numpy writing the same bytes
   (`jax.device_get` + `np.save`), and the restore;
6. the largest example LM the chip trains: GPT-2 sizes from large down (`--steps 20`, remat and attention left
   to auto, at the preset's batch, then half of it), the first that trains;
7. `user` and `user-fast`: a user's Llama-style model in its own package (tests/user_tasks/llama.py, grouped-query
   attention 12/4 through `jax.nn.dot_product_attention`, SwiGLU, RoPE, untied head, scanned blocks under
   `nnx.remat`), `--preset gpt2-small-size` (152.8M, batch 16 x 1,024), as written and after docs/your-model.md's
   lines (tests/user_tasks/llama_fast.py: `job.kernels`), 60 steps each.

8. `preempt`: SIGTERM to GPT-2 large's shape (838M, remat full, batch 16) after its step-15 line, one process:
   the step its save starts at, signal -> written -> exit, the disk's synced write rate beside them; then the same
   command resumed to step 25.

`--repeats N` runs each training step N times (the table gives the median's run and every run's tokens/s).

Each step is skipped when less of --budget-s is left than it needs; the file says which. MFU counts 6N +
12 L d T FLOPs per trained token (bench/mfu.py) against the chip's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from bench.ckpt.disk import synced_write_rate
from bench.mfu import GPT2_SMALL, M400, PEAK_BF16_TFLOPS, flops_per_token
from bench.procs import ROOT, records


def model_flags(dim: int, heads: int, layers: int) -> list[str]:
    return ["--model.dim", str(dim), "--model.heads", str(heads), "--model.layers", str(layers),
            "--model.mlp-dim", str(4 * dim)]


M400_FLAGS = model_flags(1024, 16, 24)
# the ~400M command of docs/tpu.md as a user runs it: remat left to auto
M400_RUN = ["--preset", "gpt2-small", *M400_FLAGS, "--accum-steps", "2", "--steps", "60", "--eval-every", "1000"]


def matmul_params(cfg: dict) -> int:
    """The example LM's parameters in matmuls: four projections and the MLP a layer, and the head."""
    d, m = cfg["dim"], cfg["mlp_dim"]
    return cfg["layers"] * (4 * d * d + 2 * d * m) + d * cfg["vocab_size"]


def peak(kind: str) -> float:
    return next((t for key, t in PEAK_BF16_TFLOPS if key.lower() in kind.lower()), float("nan")) * 1e12


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def train(name: str, flags: list[str], run_dir: Path, timeout_s: float, log_dir: Path) -> dict:
    """`python -m job train FLAGS` into run_dir; its return code, wall time and metrics."""
    began = time.monotonic()
    done = run_logged(name, ["job", "train", *flags, "--run-dir", str(run_dir)], log_dir, timeout_s)
    return {"name": name, "command": "python -m job train " + shlex.join(flags), "code": done.returncode,
            "wall_s": time.monotonic() - began, "metrics": read_metrics(run_dir),
            "first_step_s": first_step_s(run_dir), "remat": chosen_remat(done.stdout)}


def first_step_s(run_dir: Path) -> float:
    """Start-up and compilation (the first step's extra time included) from summary.json's goodput: the time to the
    first step; nan without a summary."""
    path = run_dir / "summary.json"
    split = json.loads(path.read_text()).get("goodput", {}) if path.exists() else {}
    return float(split.get("startup_s", float("nan"))) + float(split.get("compile_s", float("nan")))


def chosen_remat(output: str) -> str | None:
    """The policy of the run's `remat auto: POLICY (...)` line; None without one."""
    line = next((line for line in output.splitlines() if "remat auto: " in line), None)
    return None if line is None else line.split("remat auto: ", 1)[1].split()[0]


def run_logged(name: str, args: list[str], logs: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`python -m ARGS`, its output written to logs/NAME.log as it comes (kept when it outlasts `timeout_s`: it is
    stopped, exit 124, and the steps after it still run); its exit code and output."""
    argv = [sys.executable, "-m", *args]
    path = logs / f"{name}.log"
    with path.open("w") as log:
        try:
            code = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  check=False).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return subprocess.CompletedProcess(argv, code, path.read_text())


def llama_flops_per_token(dim: int = 768, layers: int = 12, heads: int = 12, kv_heads: int = 4, mlp: int = 2048,
                          vocab: int = 50304, seq_len: int = 1024) -> float:
    """6N + 12 L d T for tests/user_tasks/llama.py: N its matmuls' parameters (q, k, v, o, SwiGLU's three, the
    head); 0.798 GFLOP a token at gpt2-small-size."""
    head_dim = dim // heads
    per_layer = dim * heads * head_dim * 2 + dim * kv_heads * head_dim * 2 + 3 * dim * mlp
    return 6 * (layers * per_layer + dim * vocab) + 12 * layers * dim * seq_len


def summarize(run: dict, cfg: dict | None, kind: str) -> dict:
    """tokens/s (median over the log intervals after the first) and MFU (cfg: the example LM's sizes; None: the
    user's Llama at gpt2-small-size); the train and eval curves."""
    rows = run["metrics"]
    trains = [r for r in rows if r.get("split") == "train"]
    rates = [r["tok_per_s"] for r in trains[1:] if "tok_per_s" in r]
    rate = statistics.median(rates) if rates else float("nan")
    fpt = llama_flops_per_token() if cfg is None else flops_per_token(argparse.Namespace(**cfg), matmul_params(cfg))
    return {**run, "tok_per_s": rate, "mfu": rate * fpt / peak(kind),
            "train": [(r["step"], r["loss"], r.get("accuracy")) for r in trains],
            "eval": [(r["step"], r["loss"], r.get("accuracy")) for r in rows if r.get("split") == "eval"]}


def repeated(name: str, times: int, run: Callable[[str], dict]) -> dict:
    """`run(name)` `times` times (names name, name-2, ...): the run of the median tokens/s, with every run's."""
    done = [run(name if i == 0 else f"{name}-{i + 1}") for i in range(times)]
    ordered = sorted(done, key=lambda r: (r["code"] != 0, r["tok_per_s"] if r["tok_per_s"] == r["tok_per_s"] else 0))
    median = ordered[(len(ordered) - 1) // 2] if times > 1 else done[0]
    return {**median, "name": name, "runs": [(r["tok_per_s"], r["mfu"], r["code"]) for r in done],
            "first_steps": [r.get("first_step_s", float("nan")) for r in done]}


def versions() -> dict:
    """Versions, and the device as a child process sees it: this process never holds the chip (its steps'
    processes each need it alone)."""
    probe = subprocess.run([sys.executable, "-c", "import jax; d = jax.devices(); print(len(d), d[0].device_kind)"],
                           capture_output=True, text=True, timeout=300, check=False)
    count, _, kind = (probe.stdout.strip().splitlines() or ["0 unknown"])[-1].partition(" ")
    out = {"python": platform.python_version(), "device_kind": kind, "devices": count}
    for package in ("jax", "jaxlib", "libtpu", "libtpu-nightly", "flax", "optax", "orbax-checkpoint"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


def curve(points: list, every: int) -> str:
    """'step: loss (accuracy)' at every `every`-th step, and the last."""
    chosen = [p for p in points if p[0] % every == 0] + ([points[-1]] if points and points[-1][0] % every else [])
    return ", ".join(f"{s}: {loss:.3f}" + (f" ({acc:.3f})" if acc is not None else "") for s, loss, acc in chosen)


# the largest LM: GPT-2 large and medium, a 600M between them (dim, heads, layers), tried from the top
LARGEST = ((1280, 20, 36), (1152, 18, 32), (1024, 16, 24))


def section_lines(title: str, record: dict) -> list[str]:
    """A benchmark Section's record (bench.report) as Markdown lines under `title`."""
    lines = [f"## {title}", "", "| " + " | ".join(record["columns"]) + " |", "|" + "---|" * len(record["columns"])]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in record["rows"]]
    lines += [""] + [f"- {a}: {b} (goal {c})" for a, b, c in record["headline"]]
    return lines + [f"- {note}" for note in record["notes"]] + [""]


def report(env: dict, runs: dict, mfu_records: list[dict], skipped: list[str], argv: list[str],
           ckpt_record: dict | None = None, preempted: dict | None = None) -> str:
    kind = env["device_kind"]
    lines = ["# The example LM on a TPU chip", "",
             f"Written by `python -m bench.tpu {shlex.join(argv)}` on {kind} ({env['devices']} device(s)); "
             + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("device_kind", "devices")) + ".",
             f"Peak: {peak(kind) / 1e12:.0f} TFLOP/s dense bf16; MFU = (6N + 12 L d T) x tokens/s / peak.", ""]
    lines += ["## Training through the loop (`python -m job train`)", "",
              "| run | command | tokens/s | MFU | remat auto | to the first step | wall | exit |",
              "|---|---|---|---|---|---|---|---|"]
    for run in runs.values():
        several = len(run.get("runs", ())) > 1
        each = (" (median of " + ", ".join(f"{m:.1%}" for _, m, _ in run["runs"]) + ")") if several else ""
        firsts = ", ".join(f"{f:.0f} s" for f in run.get("first_steps", [run.get("first_step_s", float("nan"))]))
        lines.append(f"| {run['name']} | `{run['command']}` | {run['tok_per_s']:,.0f} | {run['mfu']:.1%}{each} | "
                     f"{run.get('remat') or '-'} | {firsts} | {run['wall_s']:.0f} s | {run['code']} |")
    lines.append("")
    for run in runs.values():
        lines += [f"**{run['name']}**: train loss (accuracy) by step: {curve(run['train'], 100)}", "",
                  f"eval loss (accuracy): {curve(run['eval'], 100)}", ""]
    for record in mfu_records:
        lines += section_lines("Template step against a hand-written `jax.jit` step (`python -m bench.mfu`)",
                               record)
    if ckpt_record:
        lines += section_lines("The checkpoint from HBM (`python -m bench.ckpt worker --size gpt2-small`)",
                               ckpt_record)
    if preempted:
        lines += preempt_lines(preempted)
    if skipped:
        lines += ["## Not measured in this run", ""] + [f"- {s}" for s in skipped] + [""]
    return "\n".join(lines)


def preempt_lines(p: dict) -> list[str]:
    """The preemption's timeline as Markdown: signal -> written -> exit, the disk's rate beside."""
    rate = p["disk_synced_bytes_per_s"] / 2**20
    lines = ["## SIGTERM to the largest example LM (`--only preempt`)", "", f"`{p['command']}`, SIGTERM after its "
             f"step-15 line: exit {p['code']}, written {p['written_s']} s after the signal, exit "
             f"{p['after_written_s']} s after that ({p['exit_s']} s in all); this disk writes {rate:,.0f} MiB/s synced. "
             f"`{p['saved_line']}`. The same command again: exit {p['resumed_code']}, `{p['resumed_line']}`.", "",
             "| s from the signal | line |", "|---|---|"]
    lines += [f"| {t:+.2f} | `{line[:160]}` |" for t, line in p["timeline"] if t is not None and t >= -5]
    return lines + [""]


def train_largest(work: Path, logs: Path, left: Callable[[], float], kind: str) -> dict | None:
    """The first of LARGEST that trains 20 steps at the preset's batch of 16, else at 8 (a configuration that does
    not fit stops at its first step with exit 2, one line); its run's summary, named by its size and batch."""
    for dim, heads, layers in LARGEST:
        for batch in (16, 8):
            if left() < 90:
                return None
            name = f"largest-d{dim}-l{layers}-b{batch}"
            flags = ["--preset", "gpt2-small", *model_flags(dim, heads, layers), "--data.global-batch", str(batch),
                     "--steps", "20", "--eval-every", "1000", "--log-every", "5"]
            run = train(name, flags, work / name, left(), logs)
            if run["code"] == 0:
                cfg = {**GPT2_SMALL, "dim": dim, "heads": heads, "layers": layers, "mlp_dim": 4 * dim}
                return {**summarize(run, cfg, kind), "name": f"largest: {matmul_params(cfg) / 1e6:,.0f}M in matmuls "
                                                             f"(dim {dim}, {layers} layers), batch {batch}"}
    return None


def preempt(work: Path, logs: Path, left: Callable[[], float]) -> dict:
    """SIGTERM to the 838M run after its step-15 line; its timeline (seconds from the signal, each line as it came),
    then the same command resumed to the end."""
    run_dir = work / "preempt"
    flags = ["--preset", "gpt2-small", *model_flags(*LARGEST[0]), "--model.remat", "full", "--steps", "25",
             "--eval-every", "1000", "--log-every", "5", "--ckpt.every", "1000", "--run-dir", str(run_dir)]
    argv = [sys.executable, "-m", "job", "train", *flags]
    stamped: list[tuple[float, str]] = []
    signal_at = None
    with (logs / "preempt.log").open("w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.monotonic()
            if signal_at is None and "step 15/" in line:
                proc.send_signal(signal.SIGTERM)
                signal_at = now
            stamped.append((now, line.rstrip()))
            log.write(f"{now - (signal_at or now):+9.3f} {line}")
            log.flush()
        code = proc.wait()
        ended = time.monotonic()
    since = lambda t: None if signal_at is None else round(t - signal_at, 3)  # noqa: E731
    saved = next(((t, line) for t, line in stamped if "preempted: saved step" in line), None)
    resumed = run_logged("preempt-resumed", ["job", "train", *flags], logs, max(left(), 60))
    return {"command": "python -m job train " + shlex.join(flags[:-2]), "code": code,
            "saved_line": saved[1] if saved else None, "written_s": since(saved[0]) if saved else None,
            "exit_s": since(ended), "after_written_s": round(ended - saved[0], 3) if saved else None,
            "timeline": [(since(t), line) for t, line in stamped if signal_at is not None and t >= signal_at - 30],
            "resumed_code": resumed.returncode,
            "resumed_line": next((x for x in resumed.stdout.splitlines() if "resumed from step" in x), None),
            "disk_synced_bytes_per_s": synced_write_rate(work)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tpu")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS-tpu.md")
    p.add_argument("--corpus", type=Path, default=None,
                   help="a folder with stdlib.npy (python -m bench.corpus), made there first where it has none")
    p.add_argument("--budget-s", type=float, default=3600.0, help="stop starting steps after this long")
    p.add_argument("--text-steps", type=int, default=1000)
    p.add_argument("--steps", type=int, default=0, help="the synthetic run's steps (0: the preset's 1,000)")
    p.add_argument("--only", default="synthetic,mfu,text,400m,400m-explicit,mfu400m,ckpt,largest,preempt",
                   help="the steps to run, comma-separated")
    p.add_argument("--logs", type=Path, default=None, help="where each step's output goes (default: a temp folder)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each training step (the median is reported)")
    args = p.parse_args(argv)
    began = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - began)  # noqa: E731
    env = versions()
    work = Path(tempfile.mkdtemp(prefix="bench-tpu-"))
    logs = args.logs or work
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    skipped: list[str] = []
    mfu_records: list[dict] = []
    ckpt_record = None
    preempted = None
    plan = [("user-fast", 90 * args.repeats), ("user", 90 * args.repeats),
            ("synthetic", 100 + 0.2 * (args.steps or 1000)), ("mfu", 100), ("mfu400m", 120),
            ("text", 60 + 0.2 * args.text_steps), ("400m", 150), ("400m-explicit", 90), ("ckpt", 120),
            ("largest", 420),
            ("preempt", 480)]
    kind = env["device_kind"]

    def trained(step: str, flags: list[str], cfg: dict | None) -> dict:
        return repeated(step, args.repeats, lambda name: summarize(train(name, flags, work / name, left(), logs),
                                                                   cfg, kind))

    for step, needs in plan:
        if step not in args.only.split(","):
            continue
        if left() < needs:
            skipped.append(f"{step}: {left():.0f} s of the budget left, it needs about {needs:.0f} s")
            continue
        if step == "synthetic":
            flags = ["--preset", "gpt2-small", *(["--steps", str(args.steps)] if args.steps else [])]
            runs[step] = trained(step, flags, GPT2_SMALL)
        elif step in ("mfu", "mfu400m"):
            size = "400m" if step == "mfu400m" else "gpt2-small"
            out = run_logged(step, ["bench.mfu", "worker", "--quick", "--size", size], logs, left())
            found = records(out.stdout)
            mfu_records += found[-1:]
            if not found:
                skipped.append(f"{step}: exited {out.returncode} without a record (see {step}.log)")
        elif step == "text":
            if not args.corpus:
                skipped.append("text: no --corpus (python -m bench.corpus DIR makes one)")
                continue
            if not (args.corpus / "stdlib.npy").exists():  # made here, on the VM's own standard library
                made = run_logged("corpus", ["bench.corpus", str(args.corpus)], logs, left())
                if made.returncode != 0:
                    skipped.append(f"text: python -m bench.corpus {args.corpus} exited {made.returncode} (corpus.log)")
                    continue
            flags = ["--preset", "gpt2-small", "--data.source", str(args.corpus / "stdlib.npy"),
                     "--steps", str(args.text_steps)]
            runs[step] = summarize(train(step, flags, work / step, left(), logs), GPT2_SMALL, env["device_kind"])
        elif step == "400m":
            runs[step] = trained(step, M400_RUN, M400)
        elif step == "400m-explicit":  # the policy the auto runs chose, passed: their time to the first step's baseline
            policy = next((r["remat"] for r in runs.values() if r["name"] == "400m" and r.get("remat")), "dots")
            runs[step] = summarize(train(step, [*M400_RUN, "--model.remat", policy], work / step, left(), logs),
                                   M400, kind)
        elif step in ("user", "user-fast"):
            module = "llama" if step == "user" else "llama_fast"
            flags = ["--task", f"tests.user_tasks.{module}:TASK", "--preset", "gpt2-small-size", "--steps", "60"]
            runs[step] = trained(step, flags, None)
        elif step == "ckpt":
            out = run_logged(step, ["bench.ckpt", "worker", "--size", "gpt2-small"], logs, left())
            found = records(out.stdout)
            ckpt_record = found[-1] if found else None
            if not found:
                skipped.append(f"ckpt: exited {out.returncode} without a record (see ckpt.log)")
        elif step == "preempt":
            preempted = preempt(work, logs, left)
        else:
            largest = train_largest(work, logs, left, env["device_kind"])
            if largest is None:
                skipped.append(f"largest: none of {LARGEST} trained within the budget (see largest-*.log)")
            else:
                runs[step] = largest
        print(f"[bench tpu] {step} done, {left():.0f} s left", file=sys.stderr, flush=True)
    args.out.write_text(report(env, runs, mfu_records, skipped, argv, ckpt_record, preempted))
    (logs / "runs.json").write_text(json.dumps({"env": env, "runs": runs, "mfu": mfu_records, "preempt": preempted},
                                               default=str))
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
