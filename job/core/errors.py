"""Errors that say what was expected, what was found, and how to fix it, and the checks that raise them
(`require` for a config value, `as_config_error` for a value read by job.core.values)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from types import TracebackType

from job.core import exits, values
from job.core.values import BadValue

BAD_INPUT_EXIT_CODE = exits.BAD_INPUT  # a ConfigError, wherever it is found: before the start or inside the run

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


_AS_READ = object()  # as_config_error's default found: the text the parser refused


class as_config_error(contextlib.AbstractContextManager[None]):  # lower case, as contextlib.suppress
    """A BadValue raised inside becomes `ConfigError(what, ...)`: with its own expected and found unless
    given (a whole text of which a part was refused, a message of its own), and `fix`.

        with as_config_error("NODES", fix="e.g. NODES=4"):
            nodes = values.whole(text, minimum=1)
    """

    def __init__(self, what: str, *, fix: str, expected: str | None = None, found: object = _AS_READ) -> None:
        self.what, self.fix, self.expected, self.found = what, fix, expected, found

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if isinstance(exc, BadValue):
            raise ConfigError(self.what, expected=exc.expected if self.expected is None else self.expected,
                              found=exc.found if self.found is _AS_READ else self.found, fix=self.fix) from None


# argparse types of a duration flag (job.core.values.seconds, positive_seconds), for the scripts that
# import them from job.errors
seconds = values.for_argparse(values.seconds)
positive_seconds = values.for_argparse(values.positive_seconds)


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

