"""Errors that say what was expected, what was found, and how to fix it, and the checks that raise them
(`require` for a config value, `seconds` and `positive_seconds` for a duration flag)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

BAD_INPUT_EXIT_CODE = 2  # a ConfigError, wherever it is found: before the start or inside the run

_PUBLIC_MODULE = "job.errors"  # where users import these from: tracebacks and pickles name it


class JobError(Exception):
    """Base class of the errors this package raises on purpose."""

    __module__ = _PUBLIC_MODULE

    # True once the message is on this process's stderr (printed before a collective exit,
    # so a peer that exits first cannot cut it off): the exit hook does not print it again.
    reported: bool = False


class ConfigError(JobError, ValueError):
    """Bad input: a value that cannot work, caught before anything starts.

    The message always has the same three parts, so users learn where to look:
    what was expected, what was found, and the fix.
    """

    __module__ = _PUBLIC_MODULE

    def __init__(self, what: str, *, expected: str, found: object, fix: str) -> None:
        self.what = what
        self.expected = expected
        self.found = found
        self.fix = fix
        super().__init__(
            f"{what}: expected {expected}, found {found!r}. Fix: {fix}"
        )


def require(ok: bool, what: str, expected: str, found: object, fix: str) -> None:
    """Raise `ConfigError(what, expected=..., found=..., fix=...)` unless `ok`."""
    if not ok:
        raise ConfigError(what, expected=expected, found=found, fix=fix)


class InitOrderError(JobError, RuntimeError):
    """`job.initialize` was called after JAX had already started its backends."""

    __module__ = _PUBLIC_MODULE


def refuse_dash_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Exit 2 on `--opt=--`: argparse drops a value that is exactly '--', so the default would apply."""
    for arg in argv:
        option, eq, value = arg.partition("=")
        if option.startswith("--") and eq and value == "--":
            parser.error(f"{option}: expected a value, found '--'. Fix: give {option} a real value, "
                         "or leave it out for the default")


def seconds(text: str) -> float:
    """A duration flag: a finite number of seconds >= 0 (NaN, inf and negatives are typos)."""
    return _duration(text, positive=False)


def positive_seconds(text: str) -> float:
    """A duration flag that cannot be 0 (a poll interval, a timeout): a finite number of seconds > 0."""
    return _duration(text, positive=True)


def _duration(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise argparse.ArgumentTypeError(f"expected a number of seconds {'>' if positive else '>='} 0, "
                                         f"found {text!r}")
    return value
