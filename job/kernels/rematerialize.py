"""What each block of a model keeps for the backward pass, by policy name, for any nnx module or stack of
blocks; and the blocks' inputs kept split by rows.

    block_fn = remat(call, "dots")         # call(block, x, *rest) -> y; "none", "dots", "full", "dots_all", "auto"
    y = block_fn(block, x)                 # inside nnx.scan over a stack, or once a block of a list
    block_fn = remat(call, cfg.remat, flag="--remat")  # an unknown policy's error names the caller's flag

| policy | what a block keeps | recomputed in the backward pass |
|---|---|---|
| `none` | every activation | nothing |
| `dots` | the projections' outputs (x @ W) and attention's output (`job.kernels.attention` names it) | the rest |
| `dots_all` | every matmul's output, attention's scores too | the rest |
| `full` | only the block's input | the whole block |
| `auto` | what the training loop chose by compiling the step (`choosing`); an error where nothing chose |

`auto` is a choice the training loop makes (job/train/remat_auto.py) and traces its steps inside. A model
traced anywhere else (a notebook, a test, an evaluation of your own) with `auto` is one ConfigError, never a
silent policy: give it an explicit one, or trace it inside `choosing`:

    with choosing("dots"):                 # what `auto` stands for in this trace
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)

`remat(call, policy)` also lays the block's input out by rows (`job.sharding.constrain` with
("batch", "length", "embed") for a [B, L, D] input, ("batch", ...) otherwise): under `--rule fsdp` a
model that annotates only its parameters would otherwise have XLA split its activations along "embed"
as the parameters are, each device holding every row of the batch (docs/sharding.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from job.core.errors import ConfigError
from job.core.flags import passing
from job.kernels.self_attention import RESIDUALS
from job.parallel.sharding import constrain

POLICIES: dict[str, Any] = {
    "none": None,  # no remat: every activation is kept
    "full": jax.checkpoint_policies.nothing_saveable,  # only the block's input: least memory, most recompute
    # the projections' outputs (x @ W) and attention's output (with splash's residuals): attention is not recomputed
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(RESIDUALS)),
    "dots_all": jax.checkpoint_policies.checkpoint_dots,  # every matmul's output, attention's too
}
NAMES = (*POLICIES, "auto")
CANDIDATES = ("none", "dots", "full")  # auto's order: the fastest first, the least memory last
ROWS = ("batch", "length", "embed")  # a block's [B, L, D] input: split by rows (and positions), width whole

# the policy `auto` stands for while a step is traced: set by the loop (`choosing`) for the trace it runs or
# compiles ahead (a context variable: each thread sees its own; outside the context `auto` is an error, never a
# silent policy)
_CHOSEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("job_remat_chosen", default=None)


def name(policy: str | bool) -> str:
    """A remat setting as a policy name; True and False (a config's on/off flag) read as "full" and "none"."""
    if isinstance(policy, bool):
        return "full" if policy else "none"
    return policy


def check(policy: object, flag: str = "policy") -> str:
    """The policy name of `policy`, or a ConfigError naming the names there are and `flag`, the caller's name
    for the setting (a model's command-line flag; default: the argument)."""
    if not isinstance(policy, (str, bool)) or name(policy) not in NAMES:
        raise ConfigError(flag, expected=f"one of {', '.join(NAMES)} (or True / False)", found=policy,
                          fix=f"pass {passing(flag, 'auto')} (the most the memory holds), {passing(flag, 'full')} "
                              f"(least memory) or {passing(flag, 'dots')} (keeps the projections' outputs)")
    return name(policy)


@contextlib.contextmanager
def choosing(policy: str) -> Iterator[None]:
    """Inside, `auto` stands for `policy` (one of CANDIDATES): the loop traces or compiles its step in it."""
    token = _CHOSEN.set(check(policy))
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def resolve(policy: str | bool, flag: str = "policy") -> str:
    """The policy a block runs under: `policy`, or for auto the one the run chose (`choosing`); a ConfigError
    for auto where nothing chose (a trace outside the training loop's), its fix naming `flag` (`check`)."""
    asked = check(policy, flag)
    if asked != "auto":
        return asked
    chosen = _CHOSEN.get()
    if chosen is None:
        raise ConfigError("remat policy", expected="an explicit policy (none, dots, full, dots_all) where a model "
                          "is traced outside the training loop", found="auto, with no policy chosen for it",
                          fix="`auto` is chosen by the training loop, which compiles the step under each policy; "
                              f"outside it pass an explicit policy (e.g. {passing(flag, 'dots')}), or trace inside "
                              "job.kernels.rematerialize.choosing(policy), e.g. "
                              "`with choosing(\"none\"): loss = loss_fn(model, batch)`")
    return chosen


def rows_split(x: Any) -> Any:
    """A block's input laid out by rows under the run's rules (as it is outside them, or for a non-array)."""
    if not isinstance(x, jax.Array) or x.ndim == 0:
        return x
    return constrain(x, ROWS if x.ndim == 3 else ("batch", *([None] * (x.ndim - 1))))


def remat(call: Callable[..., Any], policy: str | bool = "auto", *, flag: str = "policy") -> Callable[..., Any]:
    """`call(block, x, *rest)` with its input x kept split by rows, under nnx.remat with the named policy (none:
    as it is). `auto` is resolved when the result is called, inside the trace of the step. A policy that is
    not one is a ConfigError naming `flag`, the caller's name for it (`check`)."""

    @functools.wraps(call)
    def kept(block: Any, x: Any, *rest: Any) -> Any:
        return call(block, rows_split(x), *rest)

    wrapped = {p: kept if p == "none" else nnx.remat(kept, policy=POLICIES[p]) for p in POLICIES}

    @functools.wraps(call)
    def run(block: Any, x: Any, *rest: Any) -> Any:
        return wrapped[resolve(policy, flag)](block, x, *rest)

    check(policy, flag)
    return run


__all__ = ["CANDIDATES", "NAMES", "POLICIES", "ROWS", "check", "choosing", "name", "remat", "resolve", "rows_split"]
