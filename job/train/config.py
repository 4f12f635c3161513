"""The training run's configuration: one typed, frozen dataclass tree.

    python -m job train [--task lm] --steps 200 --model.layers 4 --data.global-batch 64

Every field below is a command-line flag (nested ones as `--section.field`);
`model` and `data` are the task's own config classes (job/tasks/NAME/).
`validate(cfg, task)` refuses a value that cannot work (zero steps, a NaN
learning rate, ...) before anything starts. The resolved config is saved as
`config.json` in the run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, get_type_hints

from job.core import rundir
from job.core.errors import ConfigError
from job.core.storage import url_problem
from job.core.values import integer
from job.observe.metrics import WandbConfig
from job.parallel import mesh_flag
from job.runs.config import CheckpointConfig, checks_of

if TYPE_CHECKING:
    from job.train.task import Task

M = TypeVar("M")  # the task's model config
D = TypeVar("D")  # the task's data config

MAX_STEPS = 2**31 - 1  # optax counts steps in int32
MAX_SEED = 2**63 - 1  # jax.random.key takes a C long
MAX_ACCUM = 4096  # micro-batches per step; more is a typo (each one is a scan iteration)


OPTIMIZER_NAMES = ("adamw", "adam", "sgd", "lion", "adafactor")  # --optim.name (job/train/optimizers.py)
SCHEDULE_NAMES = ("cosine", "linear", "constant", "warmup-stable-decay")  # --optim.schedule


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # adamw, adam, sgd (momentum b1), lion or adafactor (job/train/optimizers.py)
    schedule: str = "cosine"  # after the warmup: cosine, linear, constant or warmup-stable-decay
    lr: float = 3e-3  # peak learning rate, reached after the warmup
    warmup_steps: int = 20  # linear warmup from 0
    min_lr_ratio: float = 0.1  # cosine, linear and the stable schedule's decay end at lr * min_lr_ratio
    decay_fraction: float = 0.2  # warmup-stable-decay: the last fraction of the steps decays
    # the steps the schedule spans (0 = --steps): keep it when a resume raises --steps, and the decay stays put
    decay_steps: int = 0
    weight_decay: float = 0.01  # decoupled weight decay (adamw, lion, adafactor)
    clip_norm: float = 1.0  # global gradient norm clip (0 = no clipping)
    b1: float = 0.9  # Adam's and Lion's beta1; SGD's momentum
    b2: float = 0.98  # Adam's and Lion's beta2


@dataclasses.dataclass(frozen=True)
class EmaConfig:
    decay: float = 0.0  # keep an exponential moving average of the parameters, evaluated beside them (0 = off)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    steps: str = ""  # trace steps A:B (both included, e.g. 10:15) to RUN_DIR/profile/process-N ("" = off)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Generic[M, D]):
    model: M  # the task's model config: --model.*
    data: D  # the task's data config: --data.* (global_batch, eval_batches, ...)
    task: str = "lm"  # the task to train: a folder under job/tasks/
    # a named experiment of the task (Task.presets): its model and data configs; flags given beside it win
    preset: str = ""
    run_dir: str = "runs/example"  # checkpoints, metrics.jsonl, config.json, summary.json; or gs://BUCKET/FOLDER
    steps: int = 200  # total optimizer steps of the run (a resumed run continues to this)
    seed: int = 0  # parameter initialisation seed
    log_every: int = 10  # log and write metrics every N steps
    eval_every: int = 50  # evaluate on held-out data every N steps (and at the end)
    # a finite eval split (its source's split_size) is evaluated in one full pass, every row once;
    # --no-eval-full: its first --data.eval-batches batches (job/train/evaluation.py)
    eval_full: bool = True
    # how the state is split over the ("data", "model") mesh: replicated, fsdp (over "data"), tensor (over
    # "model") or fsdp_tensor (both, on a 2-D mesh); see job/parallel/vocabulary.py
    rule: str = "replicated"
    model_axis: int = 1  # devices per tensor-parallel group (the mesh's "model" axis)
    # named mesh axes with sizes, in order ("data=-1,expert=2": -1 takes the devices the others leave); empty:
    # ("data", "model") from --model-axis. Axes: data, model, expert, sequence, or a task's own (its logical_axes)
    mesh: str = ""
    accum_steps: int = 1  # micro-batches per step: gradients of K slices of the global batch, one update
    resume: bool = True  # continue from the newest complete checkpoint in run_dir
    watchdog_s: float = 600.0  # no step within this many seconds: dump every stack, exit 86 (0 = off)
    # name a host whose own time per step (input wait, dispatch) is over this x the median (job/observe/stragglers.py)
    straggler_ratio: float = 1.2
    # jax's persistent compilation cache: a folder, "none" (off), or "" = $JOB_COMPILE_CACHE, else
    # $JAX_COMPILATION_CACHE_DIR, else for a gs:// run_dir gs://BUCKET/.cache/job/jax, else
    # $XDG_CACHE_HOME/job/jax (~/.cache/job/jax); see job/runtime/compile_cache.py
    compile_cache: str = ""
    # the steps are compiled before the first step, and every process waits at the barriers "step compiled" and
    # "compiled" this many seconds for the slowest one (a host that missed the cache compiles while the others wait)
    compile_timeout_s: float = 1800.0
    optim: OptimConfig = OptimConfig()
    ckpt: CheckpointConfig = CheckpointConfig()
    ema: EmaConfig = EmaConfig()
    wandb: WandbConfig = WandbConfig()
    profile: ProfileConfig = ProfileConfig()


def _divisor_near(n: int, k: int) -> int:
    """The divisor of n nearest to k (the lower one on a tie)."""
    if not isinstance(n, int) or n < 1:
        return 1
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), d))


def _finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def defaults(task: Task) -> TrainConfig:
    """The config a run of `task` starts from: every field's default."""
    return TrainConfig(model=task.model_config(), data=task.data_config(), task=task.name)


DATA_FIELDS = ("global_batch", "eval_batches")  # what the loop reads of a task's data config
# one flag's check, (ok, flag, expected, found, fix) as job/runs/config.py's checks_of gives them; its comparison is
# written so that NaN fails it
_FlagCheck = tuple[bool, str, str, Any, str]


def validate(cfg: TrainConfig, task: Task) -> None:
    """Every check that needs no devices (run before anything starts); raises ConfigError on the first bad value."""
    _check_task(cfg, task)
    for ok, flag, expected, found, fix in (*_run_checks(cfg), *_optim_checks(cfg)):
        if not ok:
            raise ConfigError(flag, expected=expected, found=found, fix=fix)
    if cfg.profile.steps:
        from job.observe.profile import parse_steps  # jax, as rule_table in _check_task

        parse_steps(cfg.profile.steps, cfg.steps)


def _check_task(cfg: TrainConfig, task: Task) -> None:
    """The task's own checks of its configs, its eval splits, its data config's fields, the rule and the mesh."""
    # jax and flax: this module imports without them (--help, deploy's tools)
    from job.parallel.rules import rule_table
    from job.train.evaluation import check_splits

    check_splits(task.eval_splits, task.name)
    missing = [name for name in DATA_FIELDS if not hasattr(cfg.data, name)]
    if missing:
        raise ConfigError(f"Task.data_config of {task.name}", expected=f"a dataclass with the fields "
                          f"{' and '.join(DATA_FIELDS)} (the loop reads them)",
                          found=f"{type(cfg.data).__name__} without {', '.join(missing)}",
                          fix="add global_batch: int = 32 and eval_batches: int = 2 to it (docs/your-model.md)")
    rule_table(cfg.rule, getattr(task, "logical_axes", None))  # an unknown --rule, a bad declaration: its ConfigError
    axes = mesh_flag.run_axes(cfg.mesh, cfg.model_axis)
    mesh_flag.check_names(axes, cfg.mesh, getattr(task, "logical_axes", None))
    task.validate(cfg.model, cfg.data, rule=cfg.rule, model_axis=mesh_flag.model_size(axes))


def _run_checks(cfg: TrainConfig) -> tuple[_FlagCheck, ...]:
    """The checks of the run's own flags: steps, intervals, checkpoints, seed, timeouts, the run dir."""
    run_dir = cfg.run_dir
    return (
        (1 <= cfg.accum_steps <= MAX_ACCUM, "--accum-steps", f"an integer 1..{MAX_ACCUM}", cfg.accum_steps,
         "pass --accum-steps 1 (no accumulation)"),
        (cfg.accum_steps < 1 or cfg.data.global_batch % cfg.accum_steps == 0, "--accum-steps",
         f"a divisor of --data.global-batch {cfg.data.global_batch}", cfg.accum_steps,
         f"pass --accum-steps {_divisor_near(cfg.data.global_batch, cfg.accum_steps)}, or a --data.global-batch "
         f"that is a multiple of {cfg.accum_steps}"),
        (1 <= cfg.steps <= MAX_STEPS, "--steps", f"an integer 1..{MAX_STEPS}", cfg.steps, "pass --steps 200"),
        (cfg.log_every >= 1, "--log-every", "an integer >= 1", cfg.log_every, "pass --log-every 10"),
        (cfg.eval_every >= 1, "--eval-every", "an integer >= 1", cfg.eval_every, "pass --eval-every 50"),
        *checks_of(cfg.ckpt),
        (0 <= cfg.seed <= MAX_SEED, "--seed", f"an integer 0..{MAX_SEED}", cfg.seed, "pass --seed 0"),
        (_finite(cfg.watchdog_s) and cfg.watchdog_s >= 0, "--watchdog-s", "a finite number of seconds >= 0",
         cfg.watchdog_s, "pass --watchdog-s 600, or 0 to turn the watchdog off"),
        (_finite(cfg.compile_timeout_s) and cfg.compile_timeout_s > 0, "--compile-timeout-s",
         "a finite number of seconds > 0", cfg.compile_timeout_s, "pass --compile-timeout-s 1800"),
        (_finite(cfg.straggler_ratio) and cfg.straggler_ratio >= 1, "--straggler-ratio", "a finite ratio >= 1",
         cfg.straggler_ratio, "pass --straggler-ratio 1.2"),
        (bool(run_dir) and run_dir.isprintable(), "--run-dir", "a non-empty path without control characters",
         run_dir, "pass --run-dir runs/example"),
        (url_problem(run_dir) is None, "--run-dir", "a folder path or gs://BUCKET/FOLDER", run_dir,
         f"{url_problem(run_dir)}; pass e.g. --run-dir runs/example or --run-dir gs://my-bucket/run1"),
    )


def _optim_checks(cfg: TrainConfig) -> tuple[_FlagCheck, ...]:
    """The checks of the optimizer's flags and --ema.decay."""
    optim = cfg.optim
    return (
        (_finite(optim.lr) and optim.lr > 0, "--optim.lr", "a finite learning rate > 0", optim.lr,
         "pass --optim.lr 3e-3"),
        (0 <= optim.warmup_steps <= MAX_STEPS, "--optim.warmup-steps", f"an integer 0..{MAX_STEPS}",
         optim.warmup_steps, "pass --optim.warmup-steps 20 (0 for none)"),
        (0 <= optim.min_lr_ratio <= 1, "--optim.min-lr-ratio", "a fraction 0..1", optim.min_lr_ratio,
         "pass --optim.min-lr-ratio 0.1"),
        (_finite(optim.weight_decay) and optim.weight_decay >= 0, "--optim.weight-decay", "a finite number >= 0",
         optim.weight_decay, "pass --optim.weight-decay 0.01 (0 for none)"),
        (optim.name in OPTIMIZER_NAMES, "--optim.name", f"one of {', '.join(OPTIMIZER_NAMES)}", optim.name,
         "pass --optim.name adamw"),
        (optim.schedule in SCHEDULE_NAMES, "--optim.schedule", f"one of {', '.join(SCHEDULE_NAMES)}",
         optim.schedule, "pass --optim.schedule cosine"),
        (_finite(optim.decay_fraction) and 0 < optim.decay_fraction <= 1, "--optim.decay-fraction",
         "a fraction 0 < f <= 1", optim.decay_fraction, "pass --optim.decay-fraction 0.2"),
        (0 <= optim.decay_steps <= MAX_STEPS, "--optim.decay-steps", f"an integer 0..{MAX_STEPS} (0: --steps)",
         optim.decay_steps, "pass --optim.decay-steps 0 (the schedule spans --steps), or the steps it should span"),
        (_finite(optim.clip_norm) and optim.clip_norm >= 0, "--optim.clip-norm",
         "a finite gradient norm >= 0 (0: no clipping)", optim.clip_norm,
         "pass --optim.clip-norm 1.0, or 0 for no clipping"),
        (0 <= cfg.ema.decay < 1, "--ema.decay", "a decay 0 <= d < 1 (0: no average)", cfg.ema.decay,
         "pass --ema.decay 0.999, or 0 for none"),
        (0 <= optim.b1 < 1, "--optim.b1", "a decay rate 0 <= b1 < 1", optim.b1, "pass --optim.b1 0.9"),
        (0 <= optim.b2 < 1, "--optim.b2", "a decay rate 0 <= b2 < 1", optim.b2, "pass --optim.b2 0.98"),
    )


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_json(cfg: TrainConfig) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


def from_dict(values: Mapping[str, Any], task: Task) -> TrainConfig:
    """The TrainConfig that `to_dict` (a run's config.json) holds: `from_dict(to_dict(cfg), task) == cfg`.
    A field the file lacks takes its default (a config.json of an older version); one it has that the
    config does not is one error."""
    def build(kind: type, given: object, where: str) -> Any:
        if not isinstance(given, Mapping):
            raise ConfigError(where, expected=f"a JSON object of {kind.__name__}'s fields", found=given,
                              fix="pass a config.json that python -m job train wrote")
        fields = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(given) - fields)
        if unknown:
            raise ConfigError(where, expected=f"fields of {kind.__name__} ({', '.join(sorted(fields))})",
                              found=unknown, fix="remove them, or load the run with the code that wrote it")
        hints = get_type_hints(kind)
        out = {}
        for name, value in given.items():
            inner = nested[name] if kind is TrainConfig and name in nested else hints.get(name)
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):  # a nested config: its own fields
                out[name] = build(inner, value, f"{where}.{name}")
            else:
                out[name] = value
        return kind(**out)

    nested = {"model": task.model_config, "data": task.data_config}
    return build(TrainConfig, {"model": {}, "data": {}, **values}, rundir.CONFIG)


def parse(args: list[str], task: Task) -> TrainConfig:
    """Command-line flags -> the TrainConfig of `task`; an unknown flag exits with usage (code 2)."""
    import tyro  # only to parse (0.1 s): deploy's tools import this module for commands that parse nothing

    kind = TrainConfig[task.model_config, task.data_config]  # type: ignore[name-defined]  # run-time classes, for tyro
    registry = _registry()
    parsed = tyro.cli(kind, args=args, default=defaults(task), prog="python -m job train",
                      description=__doc__.split("\n")[0], registry=registry)
    if not parsed.preset:
        return parsed
    return tyro.cli(kind, args=args, default=preset(task, parsed.preset), prog="python -m job train",
                    description=__doc__.split("\n")[0], registry=registry)


def parse_onto(cfg: TrainConfig, task: Task, flags: Sequence[str]) -> TrainConfig | None:
    """`cfg` with `flags` applied by the command line's own parser for `task`, as if typed after the run's own
    flags: what a fix offered to the user does. None where the parser refuses them (a value the field's type
    does not take: `--model.remat full` for a boolean remat); nothing is printed."""
    import tyro  # only to parse, as in `parse`

    kind = TrainConfig[task.model_config, task.data_config]  # type: ignore[name-defined]  # run-time classes, for tyro
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return tyro.cli(kind, args=list(flags), default=cfg, prog="python -m job train", registry=_registry())
    except SystemExit:
        return None


def _registry() -> Any:
    """tyro's rules with one change: an integer flag is read by job.core.values.integer (plain digits, an
    optional '-'), as the launcher and the make variables read theirs; int() also took '+4', '1_000' and '٤'."""
    from tyro import constructors  # tyro only to parse, as in `parse`

    registry = constructors.ConstructorRegistry()

    @registry.primitive_rule
    def integers(info: constructors.PrimitiveTypeInfo) -> constructors.PrimitiveConstructorSpec | None:
        if info.type is not int:
            return None
        return constructors.PrimitiveConstructorSpec(
            nargs=1, metavar="INT", instance_from_str=lambda words: integer(words[0]),
            is_instance=lambda x: isinstance(x, int) and not isinstance(x, bool), str_from_instance=lambda x: [str(x)])

    return registry


def preset(task: Task, name: str) -> TrainConfig:
    """The defaults of `task` with its preset `name` applied (`--preset NAME`)."""
    presets = getattr(task, "presets", {}) or {}
    if name not in presets:
        known = ", ".join(presets) or "none"
        raise ConfigError("--preset", expected=f"one of the {task.name} task's presets: {known}", found=name,
                          fix=f"pass one of {known}, or no --preset" if presets else "drop --preset")
    model, data, *train = presets[name]()
    cfg = dataclasses.replace(defaults(task), model=model, data=data, preset=name)
    return _with(cfg, train[0] if train else {}, f"preset {name!r}")


def _with(obj: Any, changes: Mapping[str, Any], where: str) -> Any:
    """The dataclass `obj` with `changes` ({field: value, or {field: value} for a nested dataclass}) applied."""
    fields = {f.name for f in dataclasses.fields(obj)}
    out: dict[str, Any] = {}
    for field, value in changes.items():
        if field not in fields:
            raise ConfigError(f"{where}'s {field!r}", expected=f"a field of {type(obj).__name__}: "
                              f"{', '.join(sorted(fields))}", found=field, fix="name a TrainConfig field")
        current = getattr(obj, field)
        nested = isinstance(value, Mapping) and dataclasses.is_dataclass(current)
        out[field] = _with(current, value, f"{where}.{field}") if nested else value
    return dataclasses.replace(obj, **out)
