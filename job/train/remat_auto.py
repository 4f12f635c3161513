"""remat `auto`: the policy a run's blocks take, chosen by compiling the train step: the fastest that fits.

    compile_under = remat_auto.compiling(make_step, (state, batch), limit)   # the loop, the fit check, bench.mfu
    choice = remat_auto.choose(compile_under, limit=limit, first=earlier)     # earlier: a Remembered, or None
    choice.policy, choice.step, choice.line()      # "dots", the jitted step to run, the log line

`compile_under(policy)` jits the step afresh (the policy is read while it is traced, not part of jit's cache
key), traces and compiles it inside `job.kernels.rematerialize.choosing(policy)`, and returns (the step, what it
needs per device, a function giving the lowered program's text: read only where it is compared). The candidates
are tried in order (none, dots, full: the most kept first, the least memory last, so the fastest first); the first
whose peak bytes per device fit DEVICE_SHARE of what one device has is taken, the step alone: nothing else reserves
device memory beside it (a save copies the state to the host, job/runs/headroom.py). One compile where the first
fits. Where a device's memory is not known (a CPU: its arrays are the host's), the first is. A model whose blocks
do not read `auto` compiles to the same program under each: the first is taken then, wherever XLA compiled it (the
share only ranks policies; with none to choose, a step of 15.51 GiB runs on a chip of 15.75, tests/chip).

`first`: what an earlier run chose for the same step on the same devices (job/train/remat_cache.py), compiled
before the others: where it fits and its program is the one remembered (`program_of`), it is taken, one compile
in all. The record is only an order, never trusted blindly: the compile checks the fit, and a step whose program
changed since (the model's code) has the faster policies tried before the remembered one is taken.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import jax

from job.core import renamed
from job.kernels.rematerialize import CANDIDATES, choosing
from job.runtime.device_memory import Need, from_compiled, from_message, gib, is_out_of_memory

log = logging.getLogger("job.train")

# what the step's program may take of a device's memory: the rest is for the runtime's own buffers,
# fragmentation, and the programs loaded beside the step (the evaluation's)
DEVICE_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class Remembered:
    """An earlier choice for the same step: its policy, the sha256 of its lowered program (None: not recorded),
    and where it was made, for the log line ("an earlier run in runs/a")."""

    policy: str
    program: str | None = None
    where: str = "an earlier run"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The policy taken, its step (what `compile_under` returned for it), whether it fits, what each try
    needed, and whether it was taken on an earlier run's word (`remembered`)."""

    policy: str
    step: Any
    need: Need
    tried: tuple[tuple[str, Need], ...]
    fits: bool = True  # False: no candidate compiled within the device's memory
    remembered: Remembered | None = None  # the earlier choice this one repeats, taken in one compile
    text: Callable[[], str] = dataclasses.field(default=lambda: "", repr=False, compare=False)  # its program's

    def program(self) -> str:
        """The sha256 of the chosen step's lowered program: what a later run checks its own against."""
        return program_of(self.text())

    def line(self) -> str:
        """'remat auto: dots (9.80 GiB per device of 15.75 GiB; none: 30.39 GiB)', and where it repeats an
        earlier choice, 'remat auto: dots (remembered from an earlier run in runs/a, compiled once; 9.80 GiB ...)'."""
        mine = "memory not reported here" if self.need.needed is None or self.need.available is None else (
            f"{gib(self.need.needed)} per device of {gib(self.need.available)}")
        if self.remembered is not None:
            mine = f"remembered from {self.remembered.where}, compiled once; {mine}"
        others = "; ".join(f"{p}: {'an unknown amount' if n.needed is None else gib(n.needed)}"
                           for p, n in self.tried if p != self.policy)
        return f"remat auto: {self.policy} ({mine}{'; ' + others if others else ''})"


def program_of(text: str) -> str:
    """The sha256 of a lowered program's text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fits(need: Need, limit: int | None) -> bool:
    """Whether a program needing `need` fits DEVICE_SHARE of `limit` bytes a device (unknown: it does)."""
    if not need.fits:
        return False
    if limit is None or need.needed is None:
        return True
    return need.needed <= DEVICE_SHARE * limit


def choose(compile_under: Callable[[str], tuple[Any, Need, Callable[[], str]]], *, limit: int | None,
           first: Remembered | None = None) -> Choice:
    """The first of CANDIDATES whose compiled step fits (module docstring), `first`'s policy compiled before
    the others; where none fits, the last tried, not fitting (the caller raises its out-of-memory error)."""
    tried: list[tuple[str, Need]] = []
    programs: list[Callable[[], str]] = []  # each tried candidate's program text, read once, when a later one comes
    changed: Choice | None = None  # the remembered policy, fitting, whose program is no longer the one remembered
    last: Choice | None = None
    asked = first.policy if first is not None and first.policy in CANDIDATES else None
    order = order_of(first)
    unread = False  # every candidate compiles to one program: the model does not read auto
    for policy in order:
        if changed is not None and CANDIDATES.index(policy) > CANDIDATES.index(changed.policy):
            break  # slower than the remembered one, which fits
        step, need, text_of = compile_under(policy)
        text_of = functools.cache(text_of)
        if programs:
            earlier = [read() for read in programs]
            if text_of() in earlier:
                unread = True  # the model does not read auto: every candidate is this program
                break
        programs.append(text_of)
        tried.append((policy, need))
        last = Choice(policy, step, need, (), text=text_of)
        if not fits(need, limit):
            continue
        if policy != asked or first is None:
            return dataclasses.replace(last, tried=tuple(tried))
        if first.program is None or first.program == program_of(text_of()):
            return dataclasses.replace(last, tried=tuple(tried), remembered=first)
        changed = last  # the step changed since: a faster policy may fit it now
    if changed is not None:
        return dataclasses.replace(changed, tried=tuple(tried))
    assert last is not None
    if unread and last.need.fits:  # no policy to choose from: the one program XLA compiled runs, share or not
        return dataclasses.replace(last, tried=tuple(tried))
    return dataclasses.replace(last, tried=tuple(tried), fits=False)


def order_of(first: Remembered | None) -> tuple[str, ...]:
    """The order `choose` compiles the candidates in: `first`'s policy (where it is one), then CANDIDATES'."""
    asked = first.policy if first is not None and first.policy in CANDIDATES else None
    return (asked, *(p for p in CANDIDATES if p != asked)) if asked else CANDIDATES


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


__getattr__ = renamed.answer(__name__, {"HEADROOM": "DEVICE_SHARE"})  # the old name warns

__all__ = ["DEVICE_SHARE", "Choice", "Remembered", "choose", "compiling", "fits", "need_of", "order_of", "program_of"]
