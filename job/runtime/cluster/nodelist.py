"""Slurm hostlist expressions: ``node[1-4]``, ``a[01-03,07],b5``, ``gpu-[1-2]-[3-4]``.

Slurm writes the nodes of a job or step as a compressed hostlist. A name may
hold several bracket groups (their product is taken, leftmost varying slowest),
ranges keep their zero padding, and names are separated by commas outside
brackets. `scontrol show hostnames` is the reference behaviour.
"""

from __future__ import annotations

import itertools
import re

from job.core.errors import ConfigError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_FIX = "pass a Slurm hostlist such as 'node[1-4]' or 'a[01-03,07],b5' (see `scontrol show hostnames`)"


def _bad(nodelist: str, why: str) -> ConfigError:
    return ConfigError(f"Slurm nodelist ({why})", expected="a Slurm hostlist expression", found=nodelist, fix=_FIX)


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            if depth:
                raise _bad(nodelist, "nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _bad(nodelist, "']' without '['")
            depth = 0
        elif ch == "," and not depth:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise _bad(nodelist, "unclosed '['")
    parts.append(nodelist[start:])
    return parts


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']`` (padding kept)."""
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item)
        if not m:
            raise _bad(nodelist, f"range {item!r} is not N or N-M")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise _bad(nodelist, f"range {item!r} runs backwards")
        width = len(lo_s) if lo_s.startswith("0") or len(lo_s) == len(hi_s) else 0
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_name(name: str, nodelist: str) -> list[str]:
    """One comma-free name with zero or more bracket groups."""
    pieces = re.split(r"(\[[^\]]*\])", name)
    choices: list[list[str]] = []
    for piece in pieces:
        if piece.startswith("["):
            choices.append(_expand_ranges(piece[1:-1], nodelist))
        elif piece:
            choices.append([piece])
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_nodelist(nodelist: str, what: str = "Slurm nodelist") -> list[str]:
    """Every host name of a Slurm hostlist, in Slurm's order; `what` names it in errors."""
    try:
        text = nodelist.strip()
        if not text:
            raise _bad(nodelist, "empty")
        hosts: list[str] = []
        for name in _split_top_level(text):
            if not name or name.startswith("["):
                raise _bad(nodelist, f"host name {name!r} has no prefix")
            hosts.extend(_expand_name(name, nodelist))
    except ConfigError as exc:
        if what == "Slurm nodelist":
            raise
        raise ConfigError(f"{what}: {exc.what}", expected=exc.expected, found=exc.found, fix=exc.fix) from None
    return hosts


def first_node(nodelist: str, what: str = "Slurm nodelist") -> str:
    """The first host of a hostlist: where Slurm jobs put their coordinator."""
    return expand_nodelist(nodelist, what)[0]


def expand_tasks_per_node(spec: str, what: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]`` (the SLURM_TASKS_PER_NODE form)."""
    counts: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ConfigError(
                what,
                expected="counts such as '4' or '2(x3),1'",
                found=spec,
                fix="let Slurm set it (do not export it by hand)",
            )
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
