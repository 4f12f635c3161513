"""13. Expert parallelism: a mixture of experts' experts split over an "expert" mesh axis vs replicated.

    python -m bench.experts [--quick]

One process, 4 CPU devices, the MoE of tests/user_tasks/moe.py at a larger size (8 experts of 128 x 512,
32 rows x 64 tokens a step), its train state planned and created as its shards as the loop does
(`job.train.state.plan`, rule `replicated`) on two meshes:

- split: `--mesh data=1,expert=4`: every rule maps the experts' logical axis "experts" to the mesh axis
  "expert", so each device holds 2 of the 8 experts and their Adam moments; the other variables
  stay whole on every device, and the batch is split over the 4 devices;
- replicated: `--mesh data=4`: no expert axis, so the experts stay whole on every device; the batch is
  split over the same 4 devices.

Per device: the bytes of the expert kernels (`moe/wi`, `moe/wo`) held, alone and with their Adam moments,
and of the whole train state. Step time: `job.train.steps.jit_train_step` on the same batches under each
mesh's `mesh_context` (the model's `job.sharding.constrain` calls lay the dispatched tokens out over the
experts' axis), blocks of steps interleaved, the median of their per-step times after the compile. And
the collectives each compiled step holds (the dispatch's all-to-alls where the experts are split).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable

from bench.procs import emit, run_worker
from bench.report import Section, standalone
from bench.timing import fmt_ratio, fmt_s, fmt_x, interleave, median, ratio

NAME = "experts"
TITLE = "13. Expert parallelism: experts split over an expert axis vs replicated"
TASK = "tests.user_tasks.moe:TASK"
DEVICES = 4
MODEL = {"vocab": 256, "length": 64, "embed": 128, "mlp": 512, "experts": 8}
ROWS = 32
MESHES = {"split": "data=1,expert=4", "replicated": "data=4"}
EXPERT_KERNELS = ("moe/wi", "moe/wo")
COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter")  # counted in each compiled step


def held_bytes(state, kernels: tuple[str, ...]) -> dict[str, int]:  # noqa: ANN001 - an nnx.State
    """{"params": ..., "moments": ..., "state": ...}: the most bytes one device holds of the `kernels`, of
    their Adam moments (mu and nu), and of the whole train state."""
    from flax import nnx  # in the worker only, as in `layout`

    per_device: dict[str, dict[object, int]] = {"params": {}, "moments": {}, "state": {}}
    for path, var in nnx.to_flat_state(state):
        kinds = ["state"]
        if "/".join(str(part) for part in path).endswith(kernels):
            kinds += ["params"] if path[0] == "model" else ["moments"] if {"mu", "nu"} & set(path) else []
        for shard in getattr(var.get_value(), "addressable_shards", []):
            for kind in kinds:
                per_device[kind][shard.device] = per_device[kind].get(shard.device, 0) + shard.data.nbytes
    return {kind: max(found.values(), default=0) for kind, found in per_device.items()}


def layout(task, mesh_text: str, block: int,  # noqa: ANN001 - a job.task.Task
           losses: dict[str, float]) -> tuple[dict[str, dict[str, int]], int, Callable[[], float]]:
    """The MoE's train state on the mesh `mesh_text`: (the bytes a device holds and the collectives of its
    compiled step, its parameter count, a call that takes `block` steps and returns the seconds per step,
    its last loss in `losses[mesh_text]`)."""
    import jax  # in the worker only, as every jax import here: its 4 devices come from its environment

    from job import sharding
    from job.train import config
    from job.train import state as state_plan
    from job.train.batches import global_batch
    from job.train.steps import jit_train_step

    cfg = dataclasses.replace(config.defaults(task), model=task.model_config(**MODEL), mesh=mesh_text,
                              rule="replicated", data=task.data_config(global_batch=ROWS))
    mesh = sharding.make_mesh(axes=sharding.parse_mesh(mesh_text))
    rules = sharding.rule_table(cfg.rule, task.logical_axes)
    tx, _ = task.optimizer(cfg, 1000)
    planned = state_plan.plan(task, cfg, mesh, tx)
    current = {"state": planned.init()}
    step = jit_train_step(task.loss, planned.graphdef, planned.shardings, weight=task.weight)
    source = task.source(cfg.data, cfg.model)
    batches = [global_batch(source, sharding.batch_sharding(mesh), split="train", step=s, size=ROWS) for s in range(4)]

    with sharding.mesh_context(mesh, rules):
        compiled = step.lower(current["state"], batches[0]).compile().as_text()
    collectives = {op: compiled.count(f" {op}(") + compiled.count(f" {op}-start(") for op in COLLECTIVES}

    def run_block() -> float:
        with sharding.mesh_context(mesh, rules):  # the model's constrain calls read the rules while it is traced
            start = time.perf_counter()
            for i in range(block):
                current["state"], metrics = step(current["state"], batches[i % len(batches)])
            jax.block_until_ready(metrics)
        losses[mesh_text] = float(metrics["loss"])
        return (time.perf_counter() - start) / block

    held = held_bytes(current["state"], EXPERT_KERNELS)
    return {"bytes": held, "collectives": collectives}, planned.params, run_block


def measure(quick: bool) -> dict:
    """Each mesh's bytes held per device and collectives, the interleaved per-step times, and the last losses
    of both."""
    from job import task as tasks  # in the worker only, as above

    task = tasks.load(TASK)
    block, reps = (2, 3) if quick else (4, 9)
    found: dict[str, dict[str, dict[str, int]]] = {}
    variants: dict[str, Callable[[], float]] = {}
    losses: dict[str, float] = {}
    params = 0
    for name, mesh_text in MESHES.items():
        found[name], params, variants[name] = layout(task, mesh_text, block, losses)
    print(f"[bench experts] {reps} interleaved repetitions of {block} steps ...", file=sys.stderr, flush=True)
    times = interleave(variants, reps=reps, warmup=1)  # the warmup round compiles both
    return {"layouts": found, "times": times, "losses": {name: losses[MESHES[name]] for name in MESHES},
            "params": params, "block": block, "reps": reps}


def worker(argv: list[str]) -> None:
    emit(dataclasses.asdict(section(measure("--quick" in argv))))


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _collectives(counts: dict[str, int]) -> str:
    """"4 all-to-all, 3 all-gather": the collectives a compiled step holds, by kind."""
    return ", ".join(f"{counts[op]} {op}" for op in COLLECTIVES if counts[op]) or "none"


def section(r: dict) -> Section:
    s = Section(NAME, TITLE, columns=["per device", "experts split (data=1,expert=4)", "replicated (data=4)",
                                      "split / replicated"])
    split, whole = (r["layouts"][name]["bytes"] for name in MESHES)
    rows = (("expert kernels", split["params"], whole["params"]),
            ("expert kernels and their Adam moments", split["params"] + split["moments"],
             whole["params"] + whole["moments"]),
            ("the whole train state", split["state"], whole["state"]))
    for what, a, b in rows:
        s.rows.append([what, _mib(a), _mib(b), fmt_x(a / b)])
    s.rows.append(["collectives in the compiled train step",
                   *(_collectives(r["layouts"][name]["collectives"]) for name in MESHES), ""])
    t = r["times"]
    s.rows.append(["train step (median)", fmt_s(median(t["split"])), fmt_s(median(t["replicated"])),
                   fmt_ratio(t["split"], t["replicated"])])
    experts = split["params"] + split["moments"], whole["params"] + whole["moments"]
    s.headline += [
        ("expert kernels and their Adam moments per device, experts over 4 devices / replicated",
         f"{fmt_x(experts[0] / experts[1])} ({_mib(experts[0])} / {_mib(experts[1])})", "~0.25x"),
        ("whole train state per device, the same", fmt_x(split["state"] / whole["state"]), "report"),
        ("train step, experts split / replicated (4 CPU devices on this machine)",
         fmt_x(ratio(t["split"], t["replicated"])), "report"),
    ]
    s.notes.append(f"MoE of {TASK} with {MODEL} ({r['params']:,} parameters), top-2 routing, batch {ROWS} x "
                   f"{MODEL['length']} tokens, rule replicated (only the experts follow the mesh); one process, "
                   f"{DEVICES} CPU devices; step time: median of {r['reps']} interleaved repetitions of "
                   f"{r['block']} steps, after one compiling round")
    s.notes.append(f"both layouts took the same steps on the same batches: last loss {r['losses']['split']:.6f} "
                   f"split, {r['losses']['replicated']:.6f} replicated")
    s.data = {"layouts": r["layouts"], "median_step_s": {k: median(v) for k, v in t.items()},
              "losses": r["losses"], "params": r["params"]}
    return s


def run(quick: bool = False) -> Section:
    return Section.from_dict(run_worker("bench.experts", ["--quick"] if quick else [], devices=DEVICES))


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, worker))
