"""One parser per kind of value: the launcher's flags, the Slurm and TPU make variables, the environment's
variables that job.initialize reads.

    whole("4", minimum=1)     -> 4        whole(" 4"), whole("+4"), whole("٤"), whole("1e3"): BadValue
    integer("-3")             -> -3       the config's integer flags (their ranges are the config's checks)
    switch("yes")             -> True     "", 0/1, true/false, yes/no, on/off in any case; else BadValue

A BadValue says what was expected and what was found; each side turns it into its own error
(argparse's usage error, or a ConfigError naming the variable and the fix) with the same words.
"""

from __future__ import annotations

import re

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


__all__ = ["OFF", "ON", "BadValue", "integer", "switch", "whole"]
