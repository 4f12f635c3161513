"""One parser per kind of value: the launcher's flags, the Slurm and TPU make variables, the environment's
variables that job.initialize reads.

    whole("4", minimum=1)     -> 4        whole(" 4"), whole("+4"), whole("٤"), whole("1e3"): BadValue
    integer("-3")             -> -3       the config's integer flags (their ranges are the config's checks)
    switch("yes")             -> True     "", 0/1, true/false, yes/no, on/off in any case; else BadValue
    seconds("2.5")            -> 2.5      a finite number >= 0; positive_seconds: > 0

A BadValue says what was expected and what was found; each side turns it into its own error with the
same words: `for_argparse(parse)` makes argparse's usage error of it, `job.core.errors.as_config_error`
a ConfigError naming the variable and the fix.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")


class BadValue(ValueError):
    """A typed value that is not of its kind: `expected` and `found` for the caller's own error."""

    def __init__(self, expected: str, found: str) -> None:
        self.expected, self.found = expected, found
        super().__init__(f"expected {expected}, found {found!r}")


def whole(text: str, *, minimum: int = 0, maximum: int | None = None, what: str = "a whole number") -> int:
    """Plain ASCII digits only (no sign, space, exponent or underscore) read as an int in [minimum, maximum]."""
    bound = f">= {minimum}" if maximum is None else f"{minimum}..{maximum}"
    expected = f"{what} {bound}" if what == "a whole number" else what
    value = int(text) if re.fullmatch(r"[0-9]{1,30}", text) else None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        raise BadValue(expected, text)
    return value


def integer(text: str) -> int:
    """Plain ASCII digits with an optional leading '-' (no '+', space, exponent or underscore), any size."""
    if not re.fullmatch(r"-?[0-9]+", text):
        raise BadValue("an integer", text)
    try:
        return int(text)
    except ValueError:  # more digits than int() converts
        raise BadValue("an integer", text) from None


def switch(text: str) -> bool:
    """An on/off word: 1, true, yes or on; 0, false, no, off or empty (any case, nothing around it)."""
    value = text.lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise BadValue("1 or 0 (or true/false)", text)


def seconds(text: str) -> float:
    """A duration: a finite number of seconds >= 0 (NaN, inf and negatives are typos)."""
    return _duration(text, positive=False)


def positive_seconds(text: str) -> float:
    """A duration that cannot be 0 (a poll interval, a timeout): a finite number of seconds > 0."""
    return _duration(text, positive=True)


def _duration(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise BadValue(f"a number of seconds {'>' if positive else '>='} 0", text)
    return value


def for_argparse(parse: Callable[..., T], *, fix: str = "", **bounds: object) -> Callable[[str], T]:
    """`parse` (with `bounds`, e.g. minimum=1) as an argparse `type=`: a BadValue becomes argparse's usage
    error in the same words, then ". Fix: `fix`" when one is given."""

    def typed(text: str) -> T:
        try:
            return parse(text, **bounds)
        except BadValue as exc:
            raise argparse.ArgumentTypeError(f"{exc}. Fix: {fix}" if fix else str(exc)) from None

    typed.__name__ = typed.__qualname__ = parse.__name__
    return typed


__all__ = ["OFF", "ON", "BadValue", "for_argparse", "integer", "positive_seconds", "seconds", "switch", "whole"]
