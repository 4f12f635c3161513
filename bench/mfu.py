"""6. GPU and TPU: model FLOPs utilisation of the example LM at GPT-2-small size (or ~400M), on one chip.

    python -m bench.mfu [--quick] [--size gpt2-small|400m] [--batch 16] [--peak-tflops 197]
                        [--attention auto|xla|splash|flash|cudnn] [--remat auto|none|dots|full]

Runs only where a GPU or a TPU is present; elsewhere it records "skipped: no
accelerator". `--force` runs it on any backend (with `--size tiny`, a small
config: a smoke test of this file on CPU). On a TPU VM, `python -m bench.tpu`
runs it at both sizes and writes bench/RESULTS-tpu.md.

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
timed, interleaved. Attention and remat are the model's own flags
(`--model.attention`, `--model.remat`; auto: splash attention on a TPU, cuDNN on
a GPU, and the remat policy the loop would choose by compiling: job/train/remat_auto.py). Rows hold seq_len + 1
tokens, so seq_len positions train, as the lm task's rows do.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from bench.procs import ROOT, emit, run_worker
from bench.report import Section, standalone
from bench.timing import fmt_pct, fmt_s, fmt_x, interleave, median, ratio

NAME = "mfu"
TITLE = "6. GPU and TPU: model FLOPs utilisation, GPT-2-small-sized example LM"
GOAL = ">= 45%"

# the gpt2-small preset's model (job/tasks/lm/presets.py): bf16, its blocks unrolled
GPT2_SMALL = {"vocab_size": 50304, "seq_len": 1024, "dim": 768, "heads": 12, "layers": 12, "mlp_dim": 3072,
              "dtype": "bfloat16", "scan": False}
M400 = {**GPT2_SMALL, "dim": 1024, "heads": 16, "layers": 24, "mlp_dim": 4096}  # 406M parameters
TINY = {"vocab_size": 256, "seq_len": 128, "dim": 128, "heads": 4, "layers": 2, "mlp_dim": 512,
        "dtype": "bfloat16"}
SIZES = {"gpt2-small": GPT2_SMALL, "400m": M400, "tiny": TINY}

# Dense (no sparsity) bf16 peak, TFLOP/s, per device; first substring of device_kind that matches wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("TPU v5 lite", 197.0),  # v5e: device_kind "TPU v5 lite"
    ("TPU v6 lite", 918.0),  # v6e (Trillium)
    ("TPU v5p", 459.0),
    ("TPU v5", 459.0),  # v5p reports "TPU v5"
    ("TPU v4", 275.0),
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
    p.add_argument("--attention", choices=("auto", "xla", "splash", "flash", "cudnn"), default="auto",
                   help="--model.attention (auto: splash on TPU, cuDNN on GPU, XLA elsewhere)")
    p.add_argument("--remat", default="auto", help="--model.remat (auto: the most the chip's memory holds)")
    p.add_argument("--size", choices=tuple(SIZES), default="gpt2-small", help="the model (tiny: for --force on CPU)")
    p.add_argument("--force", action="store_true", help="run even without a GPU or TPU")
    p.add_argument("--tiny", action="store_true", help="--size tiny")
    return p


def worker(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    import jax

    backend = jax.default_backend()
    if backend not in ("gpu", "tpu") and not args.force:
        emit(dataclasses.asdict(skipped(f"skipped: no GPU or TPU (jax backend: {backend})")))
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
    cfg = task.model_config(**SIZES["tiny" if args.tiny else args.size], attention=args.attention,
                            remat=args.remat)
    device = jax.devices()[0]
    mesh = sharding.make_mesh(devices=[device])
    reps, block = (3, 3) if args.quick else (7, 5)
    tx, _ = make_optimizer(OptimConfig(), 1000)

    rng = np.random.default_rng(0)
    tokens = jax.device_put(rng.integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), dtype=np.int32),
                            NamedSharding(mesh, PartitionSpec("data")))
    batch = {"tokens": tokens, "mask": jnp.ones(tokens.shape, jnp.float32, device=tokens.sharding)}
    shapes = nnx.eval_shape(lambda: task.build(cfg, nnx.Rngs(0)))
    params = count_params(shapes)
    matmul_params = sum(int(x.get_value().size) for path, x in nnx.to_flat_state(nnx.state(shapes, nnx.Param))
                        if path[-1] == "kernel")

    def build():  # noqa: ANN202
        """Both steps, compiled once."""
        model = task.build(cfg, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        sharding.shard_model(model, mesh)
        sharding.shard_model(optimizer, mesh)
        graphdef, state = nnx.split({"model": model, "optimizer": optimizer})

        limit = device_memory.limit(device)  # remat auto as the loop chooses it, a fresh jit per policy
        compile_under = remat_auto.compiling(lambda: jit_train_step(task.loss, graphdef, state), (state, batch), limit)
        with sharding.mesh_context(mesh):
            choice = remat_auto.choose(compile_under, limit=limit)
        template = {"state": state}
        with sharding.mesh_context(mesh), choosing(choice.policy):
            template["state"], metrics = choice.step(state, batch)
            jax.block_until_ready(metrics)
        graphdef_b, params_b = nnx.split(task.build(cfg, nnx.Rngs(0)))
        baseline = {"p": params_b, "s": tx.init(params_b)}
        step = handwritten_step(graphdef_b, task.loss, tx)
        with choosing(choice.policy):
            baseline["p"], baseline["s"], metrics = step(baseline["p"], baseline["s"], batch)
        jax.block_until_ready(metrics)
        return choice.step, template, step, baseline, choice.policy

    from job.kernels import self_attention as kernels
    from job.kernels.rematerialize import choosing
    from job.runtime import device_memory
    from job.train import remat_auto

    errors: list[str] = []
    compile_start = time.perf_counter()
    jitted, template, step, baseline, policy = build()
    compile_s = time.perf_counter() - compile_start
    attention = kernels.choose(args.attention, length=cfg.seq_len, dtype=cfg.dtype).describe()

    def run_template() -> float:
        state = template["state"]
        with sharding.mesh_context(mesh), choosing(policy):  # a step traced again (new layouts) traces remat auto
            start = time.perf_counter()
            for _ in range(block):
                state, metrics = jitted(state, batch)
            jax.block_until_ready(metrics)
        template["state"] = state
        return (time.perf_counter() - start) / block

    def run_baseline() -> float:
        p, s = baseline["p"], baseline["s"]
        start = time.perf_counter()
        with choosing(policy):  # as the template's
            for _ in range(block):
                p, s, metrics = step(p, s, batch)
            jax.block_until_ready(metrics)
        baseline["p"], baseline["s"] = p, s
        return (time.perf_counter() - start) / block

    print(f"[bench mfu] {device.device_kind}: attention {attention}, remat {policy}, batch {args.batch}, "
          f"{reps} x {block} steps", file=sys.stderr, flush=True)
    times = interleave({"template": run_template, "baseline": run_baseline}, reps=reps, warmup=1)
    peak, peak_from = peak_flops(device.device_kind, args.peak_tflops)
    result = {
        "device_kind": device.device_kind, "backend": backend, "attention": attention,
        "attention_errors": errors, "batch": args.batch, "seq_len": cfg.seq_len,
        "tokens_per_step": args.batch * cfg.seq_len, "params": params, "remat": policy, "size": args.size,
        "peak_bytes": (device.memory_stats() or {}).get("peak_bytes_in_use"),
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
        ("step time, template / hand-written jax.jit",
         fmt_x(ratio(r["times"]["template"], r["times"]["baseline"])), "<= 1.03"),
    ]
    s.notes += [
        f"{r['device_kind']} ({r['backend']}); {r['params']:,} parameters, {r['matmul_params']:,} in matmuls; "
        f"{r['flops_per_token'] / 1e9:.3f} GFLOP per token (6N + 12 L d T); peak "
        + (f"{r['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16 ({r['peak_from']})" if r["peak_flops"]
           else r["peak_from"]),
        f"attention: {r['attention']}; remat: {r.get('remat', 'none')}"
        + (f"; peak memory {r['peak_bytes'] / 2**30:.2f} GiB" if r.get("peak_bytes") else ""),
        f"median of {r['reps']} interleaved blocks of {r['block']} steps; {r['tokens_per_step']:,} predicted "
        f"tokens per step; first step (compilation) {r['compile_s']:.0f} s.",
    ]
    return s


def skipped(reason: str) -> Section:
    s = Section(NAME, TITLE, data={"skipped": reason})
    s.headline.append(("MFU, GPT-2-small-sized example LM, bf16, one GPU or TPU chip", reason, GOAL))
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
