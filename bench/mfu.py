"""6. GPU: model FLOPs utilisation of the example LM at GPT-2-small size, on one GPU.

    python -m bench.mfu [--quick] [--batch 16] [--peak-tflops 989] [--attention auto|cudnn|xla]

Runs only where a CUDA device is present (`jax.default_backend() == "gpu"`);
elsewhere it records "skipped: no CUDA device". `--force` runs it on any
backend (with `--tiny`, a small config: a smoke test of this file on CPU).

Model: the lm task's transformer (job/tasks/lm/model.py) with vocab 50304,
seq 1024, dim 768, 12 heads, 12 layers, MLP 3072, bfloat16 activations
(float32 parameters and AdamW state, as the loop keeps them). 123.5M
parameters sit in matmuls; the untied output head adds 38.6M in the
embedding table (GPT-2 small ties them), 163M in all. Random tokens, already on the device: no input pipeline.

FLOPs per trained token (PaLM, appendix B): 6 N + 12 L d T, with N the
matmul parameters (embedding lookups cost no FLOPs), L layers, d width, T
the sequence length; causal masking is not discounted. MFU = FLOPs per
token x tokens/s / the chip's dense bf16 peak (the table below, keyed by
`device_kind`; `--peak-tflops` overrides it).

Both the template step (`job.train.steps.jit_train_step` over the split model +
optimizer state, as `job.train.loop.run` steps) and the hand-written `jax.jit` step
of bench/step.py, with the same `job.train.steps.make_optimizer` transform, are
timed, interleaved. Attention: the lm model calls
`jax.nn.dot_product_attention` without `implementation`, which jax 0.10
lowers with XLA; `--attention cudnn` (or `auto`, the default: cuDNN if it
compiles, else XLA) makes the benchmark process call it with
`implementation="cudnn"` (the fused flash-attention kernel).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

from bench.procs import ROOT, emit, run_worker
from bench.report import Section, standalone
from bench.timing import fmt_pct, fmt_s, fmt_x, interleave, median, ratio

NAME = "mfu"
TITLE = "6. GPU: model FLOPs utilisation, GPT-2-small-sized example LM"
GOAL = ">= 45%"

GPT2_SMALL = {"vocab_size": 50304, "seq_len": 1024, "dim": 768, "heads": 12, "layers": 12, "mlp_dim": 3072,
              "dtype": "bfloat16"}
TINY = {"vocab_size": 256, "seq_len": 128, "dim": 128, "heads": 4, "layers": 2, "mlp_dim": 512,
        "dtype": "bfloat16"}

# Dense (no sparsity) bf16 peak, TFLOP/s, per device; first substring of device_kind that matches wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)


def peak_flops(device_kind: str, override_tflops: float | None) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from) for a device kind; None when unknown."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_kind.lower():
            return tflops * 1e12, f"table entry {key!r}"
    return None, "unknown device kind (pass --peak-tflops)"


def flops_per_token(cfg, matmul_params: int) -> float:  # noqa: ANN001 - ModelConfig
    return 6.0 * matmul_params + 12.0 * cfg.layers * cfg.dim * cfg.seq_len


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.mfu")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the chip's dense bf16 peak, TFLOP/s")
    p.add_argument("--attention", choices=("auto", "cudnn", "xla"), default="auto",
                   help="dot_product_attention implementation (auto: cudnn if it compiles, else xla)")
    p.add_argument("--force", action="store_true", help="run even without a CUDA device")
    p.add_argument("--tiny", action="store_true", help="a small model (for --force on CPU)")
    return p


def _use_attention(impl: str | None) -> None:
    """Make every later `jax.nn.dot_product_attention(...)` call use `impl` (None: jax's default)."""
    import jax

    original = getattr(_use_attention, "original", None) or jax.nn.dot_product_attention
    _use_attention.original = original  # type: ignore[attr-defined]
    jax.nn.dot_product_attention = (original if impl is None
                                    else functools.partial(original, implementation=impl))


def worker(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    import jax

    backend = jax.default_backend()
    if backend != "gpu" and not args.force:
        emit(dataclasses.asdict(skipped(f"skipped: no CUDA device (jax backend: {backend})")))
        return
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from bench.step import handwritten_step
    from job import sharding
    from job import task as tasks
    from job.train.config import OptimConfig
    from job.train.state import count_params
    from job.train.steps import jit_train_step, make_optimizer

    task = tasks.load("lm")
    cfg = task.model_config(**(TINY if args.tiny else GPT2_SMALL))
    device = jax.devices()[0]
    mesh = sharding.make_mesh(devices=[device])
    reps, block = (3, 3) if args.quick else (7, 5)
    tx, _ = make_optimizer(OptimConfig(), 1000)

    rng = np.random.default_rng(0)
    tokens = jax.device_put(rng.integers(0, cfg.vocab_size, (args.batch, cfg.seq_len), dtype=np.int32),
                            NamedSharding(mesh, PartitionSpec("data")))
    batch = {"tokens": tokens, "mask": jnp.ones(tokens.shape, jnp.float32, device=tokens.sharding)}
    shapes = nnx.eval_shape(lambda: task.build(cfg, nnx.Rngs(0)))
    params = count_params(shapes)
    matmul_params = sum(int(x.get_value().size) for path, x in nnx.to_flat_state(nnx.state(shapes, nnx.Param))
                        if path[-1] == "kernel")

    def build(impl: str | None):  # noqa: ANN202
        """Both steps, compiled once with attention `impl`; raises if it does not compile."""
        _use_attention(impl)
        model = task.build(cfg, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        sharding.shard_model(model, mesh)
        sharding.shard_model(optimizer, mesh)
        graphdef, state = nnx.split({"model": model, "optimizer": optimizer})
        jitted = jit_train_step(task.loss, graphdef, state)  # a fresh jit per attention implementation
        template = {"state": state}
        with sharding.mesh_context(mesh):
            template["state"], metrics = jitted(state, batch)
            jax.block_until_ready(metrics)
        graphdef_b, params_b = nnx.split(task.build(cfg, nnx.Rngs(0)))
        baseline = {"p": params_b, "s": tx.init(params_b)}
        step = handwritten_step(graphdef_b, task.loss, tx)
        baseline["p"], baseline["s"], metrics = step(baseline["p"], baseline["s"], batch)
        jax.block_until_ready(metrics)
        return jitted, template, step, baseline

    impls = {"auto": ["cudnn", None], "cudnn": ["cudnn"], "xla": [None]}[args.attention]
    errors = []
    for impl in impls:
        try:
            compile_start = time.perf_counter()
            jitted, template, step, baseline = build(impl)
            compile_s = time.perf_counter() - compile_start
            attention = impl or "xla (jax default)"
            break
        except Exception as exc:  # noqa: BLE001 - a kernel that does not compile: try the next one
            errors.append(f"{impl}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            print(f"[bench mfu] attention {impl} failed: {errors[-1]}", file=sys.stderr, flush=True)
    else:
        raise SystemExit("no attention implementation compiled:\n" + "\n".join(errors))

    def run_template() -> float:
        state = template["state"]
        with sharding.mesh_context(mesh):
            start = time.perf_counter()
            for _ in range(block):
                state, metrics = jitted(state, batch)
            jax.block_until_ready(metrics)
        template["state"] = state
        return (time.perf_counter() - start) / block

    def run_baseline() -> float:
        p, s = baseline["p"], baseline["s"]
        start = time.perf_counter()
        for _ in range(block):
            p, s, metrics = step(p, s, batch)
        jax.block_until_ready(metrics)
        baseline["p"], baseline["s"] = p, s
        return (time.perf_counter() - start) / block

    print(f"[bench mfu] {device.device_kind}: attention {attention}, batch {args.batch}, "
          f"{reps} x {block} steps", file=sys.stderr, flush=True)
    times = interleave({"template": run_template, "baseline": run_baseline}, reps=reps, warmup=1)
    peak, peak_from = peak_flops(device.device_kind, args.peak_tflops)
    result = {
        "device_kind": device.device_kind, "backend": backend, "attention": attention,
        "attention_errors": errors, "batch": args.batch, "seq_len": cfg.seq_len,
        "tokens_per_step": args.batch * (cfg.seq_len - 1), "params": params,
        "matmul_params": matmul_params, "flops_per_token": flops_per_token(cfg, matmul_params),
        "peak_flops": peak, "peak_from": peak_from, "times": times, "reps": reps, "block": block,
        "compile_s": compile_s, "config": dataclasses.asdict(cfg),
    }
    emit(dataclasses.asdict(section(result)))


def section(r: dict) -> Section:
    s = Section(NAME, TITLE, columns=["step", "step time", "tokens/s", "model TFLOP/s", "MFU"], data=r)
    mfus = {}
    for kind, label in (("template", "template (job.train.steps.jit_train_step)"), ("baseline", "hand-written jax.jit")):
        t = median(r["times"][kind])
        tps = r["tokens_per_step"] / t
        achieved = tps * r["flops_per_token"]
        mfus[kind] = achieved / r["peak_flops"] if r["peak_flops"] else float("nan")
        s.rows.append([label, fmt_s(t), f"{tps:,.0f}", f"{achieved / 1e12:.3g}", fmt_pct(mfus[kind])])
    s.headline += [
        (f"MFU, template step ({r['device_kind']}, bf16, batch {r['batch']} x {r['seq_len']})",
         fmt_pct(mfus["template"]), GOAL),
        ("GPU step time, template / hand-written jax.jit",
         fmt_x(ratio(r["times"]["template"], r["times"]["baseline"])), "<= 1.03"),
    ]
    s.notes += [
        f"{r['device_kind']} ({r['backend']}); {r['params']:,} parameters, {r['matmul_params']:,} in matmuls; "
        f"{r['flops_per_token'] / 1e9:.3f} GFLOP per token (6N + 12 L d T); peak "
        + (f"{r['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16 ({r['peak_from']})" if r["peak_flops"]
           else r["peak_from"]),
        f"attention: {r['attention']}" + (f" (failed first: {'; '.join(r['attention_errors'])})"
                                          if r["attention_errors"] else ""),
        f"median of {r['reps']} interleaved blocks of {r['block']} steps; {r['tokens_per_step']:,} predicted "
        f"tokens per step; first step (compilation) {r['compile_s']:.0f} s.",
    ]
    return s


def skipped(reason: str) -> Section:
    s = Section(NAME, TITLE, data={"skipped": reason})
    s.headline.append(("MFU, GPT-2-small-sized example LM, bf16, one GPU", reason, GOAL))
    s.notes.append(f"{reason}. On a machine with one, `make bench` (or `python -m bench.mfu`) prints "
                   "tokens/s, step time and MFU against the chip's dense bf16 peak.")
    return s


def run(quick: bool = False, extra: list[str] | None = None) -> Section:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    args = (["--quick"] if quick else []) + list(extra or [])
    return Section.from_dict(run_worker("bench.mfu", args, env=env, timeout_s=900))


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        worker(argv[1:])
        return 0
    args, _ = _parser().parse_known_args(argv)
    extra = [a for a in argv if a not in ("--quick", "--json")]
    return standalone(["--quick"] if args.quick else [], lambda quick: run(quick, extra))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
