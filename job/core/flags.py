"""The few flags read before the config's own parser runs, read the way that parser reads them.

`--task` picks the task whose config the parser is built from, so it is read first; `--run-dir`
is where a rerun writes and what a TPU job mounts. tyro, the config's parser, takes
`--name VALUE` and `--name=VALUE`, each hyphen of a name also as an underscore
(`--run_dir`), and the last one given wins. Everything that reads or rewrites one of
these flags in a command line (the task loader, `python -m job rerun`, the TPU side)
goes through here, so no reader drifts from the parser. `flatten` names a saved config's fields
as its nested flags are named (`optim.lr`), for the readers that compare or show them. `passing` writes a
value in a fix as its caller gives it: after a flag, or as a keyword argument (a library function called
by a model whose flags it does not know).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from job.core.errors import ConfigError


def spellings(flag: str) -> tuple[str, ...]:
    """Every way the parser takes `flag`: `--run-dir` -> ("--run-dir", "--run_dir")."""
    name = flag.removeprefix("--")
    return tuple(dict.fromkeys((f"--{name}", f"--{name.replace('-', '_')}", f"--{name.replace('_', '-')}")))


def _matches(args: Sequence[str], flag: str) -> list[tuple[int, int, str]]:
    """(where, how many words, value) of each time `flag` is given with a value."""
    names = spellings(flag)
    found, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg in names and i + 1 < len(args):
            found.append((i, 2, args[i + 1]))
            i += 2
            continue
        name, eq, value = arg.partition("=")
        if eq and name in names:
            found.append((i, 1, value))
        i += 1
    return found


def value(args: Sequence[str], flag: str, default: str | None = None) -> str | None:
    """The value of `flag` in `args` (the last one given, as the parser takes it), else `default`."""
    found = _matches(args, flag)
    return found[-1][2] if found else default


def without(args: Sequence[str], flag: str) -> list[str]:
    """`args` with every `flag` and its value left out."""
    dropped = {i + k for i, words, _ in _matches(args, flag) for k in range(words)}
    return [arg for i, arg in enumerate(args) if i not in dropped]


def with_value(args: Sequence[str], flag: str, new: str) -> list[str]:
    """`args` with `flag` given once, as `new`: in place of the last one given, or after the command
    (a first word that is not a flag) when none was."""
    found = _matches(args, flag)
    if found:
        at = found[-1][0] - sum(words for i, words, _ in found[:-1])
        out = without(args, flag)
    else:
        out = list(args)
        at = 1 if out and not out[0].startswith("-") else 0
    out[at:at] = [flag, new]
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, field in tree.items():
        name = f"{prefix}{key}"
        if isinstance(field, Mapping):
            flat.update(flatten(field, name + "."))
        else:
            flat[name] = field
    return flat


def passing(setting: str, value: object) -> str:
    """`value` written as the fix of an error about `setting` tells its caller to give it: after a command-line
    flag (`--model.attention xla`), or as a keyword argument (`kernel='xla'`)."""
    return f"{setting} {value}" if setting.startswith("-") else f"{setting}={value!r}"


def require_command(args: Sequence[str], what: str = "ARGS") -> None:
    """`python -m job` takes its command first (train, eval, runs, ...): job arguments that start with a flag are
    refused before anything is queued, with the `train` they lack (nothing trains without it)."""
    if args and args[0].startswith("-"):
        raise ConfigError(what, expected="a command of python -m job first (train, eval, runs, ...)",
                          found=" ".join(args), fix=f"{what}='train {' '.join(args)}'")


__all__ = ["require_command", "flatten", "passing", "spellings", "value", "with_value", "without"]
