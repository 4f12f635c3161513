"""remat `auto`: the policy a run's blocks take, chosen by compiling the train step, the fastest first.

    compile_under = remat_auto.compiling(make_step, (state, batch), limit)   # the loop, the fit check, bench.mfu
    choice = remat_auto.choose(compile_under, limit=limit, beside=state_bytes)
    choice.policy, choice.step, choice.line()      # "dots", the jitted step to run, the log line

`compile_under(policy)` jits the step afresh (the policy is read while it is traced, not part of jit's cache
key), traces and compiles it inside `job.kernels.rematerialize.choosing(policy)`, and returns (the step, what it
needs per device, a function giving the lowered program's text: read only where a later candidate is compared
with it). The candidates are tried in order (none, dots, full: the most kept first, the least memory last); the
first whose peak bytes per device, with `beside` bytes for the programs that run beside it (a background
checkpoint's on-device copy of the state), fit HEADROOM of what a device has is taken; where none leaves that
room, the first that fits alone (its saves are then written from the live state, job/runs/headroom.py). Where a
device's memory is not known (a CPU: its arrays are the host's), the first is. A model whose blocks do not read
`auto` compiles to the same program under each: the first is taken then.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import jax

from job.kernels.rematerialize import CANDIDATES, choosing
from job.runtime.device_memory import Need, from_compiled, from_message, gib, is_out_of_memory

log = logging.getLogger("job.train")

# what a program and the copies beside it may take of a device's memory: the rest is for the runtime's own
# buffers, fragmentation, and the programs loaded beside the step (the evaluation's)
HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class Choice:
    """The policy taken, its step (what `compile_under` returned for it), whether it fits, and what each try
    needed."""

    policy: str
    step: Any
    need: Need
    tried: tuple[tuple[str, Need], ...]
    beside: int  # bytes per device kept free for the programs beside the step
    fits: bool = True  # False: no candidate compiled within the device's memory

    def line(self) -> str:
        """'remat auto: dots (9.80 GiB per device of 15.75 GiB, 2.61 GiB beside it; none: 30.39 GiB)'."""
        mine = "memory not reported here" if self.need.needed is None or self.need.available is None else (
            f"{gib(self.need.needed)} per device of {gib(self.need.available)}"
            + (f", {gib(self.beside)} beside it for a checkpoint's copy" if self.beside else ""))
        others = "; ".join(f"{p}: {'an unknown amount' if n.needed is None else gib(n.needed)}"
                           for p, n in self.tried if p != self.policy)
        return f"remat auto: {self.policy} ({mine}{'; ' + others if others else ''})"


def fits(need: Need, limit: int | None, beside: int) -> bool:
    """Whether a program needing `need` fits HEADROOM of `limit` with `beside` bytes kept for others."""
    if not need.fits:
        return False
    if limit is None or need.needed is None:
        return True
    return need.needed + beside <= HEADROOM * limit


def choose(compile_under: Callable[[str], tuple[Any, Need, Callable[[], str]]], *, limit: int | None,
           beside: int = 0, first: str | None = None) -> Choice:
    """The first of CANDIDATES whose compiled step fits (module docstring); where none does, the last tried, not
    fitting (the caller raises its out-of-memory error). `first`: a policy to try before the others (what an
    earlier attempt of the run chose for the same step: where it fits, one compile decides)."""
    tried: list[tuple[str, Need]] = []
    programs: list[Callable[[], str]] = []  # each tried candidate's program text, read once, when a later one comes
    alone: tuple[str, Any, Need] | None = None  # the first that fits without room beside it
    last: tuple[str, Any, Need] | None = None
    order = (first, *(p for p in CANDIDATES if p != first)) if first in CANDIDATES else CANDIDATES
    for policy in order:
        step, need, text_of = compile_under(policy)
        text_of = functools.cache(text_of)
        if programs:
            earlier = [read() for read in programs]
            if text_of() in earlier:
                break  # the model does not read auto: every candidate is this program
        programs.append(text_of)
        tried.append((policy, need))
        last = (policy, step, need)
        if fits(need, limit, beside):
            return Choice(policy, step, need, tuple(tried), beside)
        if alone is None and need.fits:  # the compiler placed it in the device's memory: it runs, without room
            alone = last
        if limit is None:
            break
    if alone is not None:  # nothing leaves room for a checkpoint's copy: the saves write from the live state
        return Choice(alone[0], alone[1], alone[2], tuple(tried), 0)
    assert last is not None
    return Choice(last[0], last[1], last[2], tuple(tried), beside, fits=False)


def need_of(compile_step: Callable[[], Any], limit: int | None) -> Need:
    """What the program `compile_step` compiles needs: XLA's out-of-memory read as a Need that does not fit."""
    try:
        compiled = compile_step()
    except jax.errors.JaxRuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        return from_message(str(exc), limit)
    return from_compiled(compiled, limit)


def compiling(make_step: Callable[[], Any], args: tuple[Any, ...], limit: int | None
              ) -> Callable[[str], tuple[Any, Need, Callable[[], str]]]:
    """`choose`'s compile_under for the jitted steps `make_step` makes (a fresh one each call), lowered for `args`
    (arrays or their abstract shapes) under each policy, against `limit` bytes a device. Call `choose` inside the
    run's mesh context, as the step is traced there."""

    def compile_under(policy: str) -> tuple[Any, Need, Callable[[], str]]:
        step = make_step()  # jitted afresh: traced under `policy`
        with choosing(policy):
            lowered = step.lower(*args)
        return step, need_of(lowered.compile, limit), lowered.as_text

    return compile_under


__all__ = ["HEADROOM", "Choice", "choose", "compiling", "fits", "need_of"]
