"""The command forms and flags the simulator accepts: a subset of the real gcloud's (gcloud 528).

Anything else is refused the way the real CLI refuses it: a message on
stderr starting with ``ERROR: (gcloud.GROUP.COMMAND)`` and exit code 2 for
argument errors (1 for values the real CLI checks after parsing, such as a
duration). Flags take ``--flag=value`` or ``--flag value``; boolean flags
take no value. The forms, the required flags and the exit codes were checked
against gcloud 528's own parser (tests/tpu/test_fake_gcloud.py lists them).
"""

from __future__ import annotations

import dataclasses
import re

USAGE_EXIT = 2


class UsageError(Exception):
    """Bad command line: exit 2 (or `code`), like the real CLI's argument errors."""

    def __init__(self, where: tuple[str, ...], message: str, code: int = USAGE_EXIT) -> None:
        super().__init__(f"ERROR: (gcloud{''.join('.' + w for w in where)}) {message}")
        self.code = code


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str  # without the leading dashes
    takes_value: bool = True  # False: a boolean switch
    required: bool = False
    pattern: str | None = None  # a regex the value must match
    repeat: bool = False  # may be given several times
    missing: str | None = None  # the real CLI's message when a required flag is absent
    bad_value_exit: int = USAGE_EXIT  # exit code for a value that does not match `pattern`


@dataclasses.dataclass(frozen=True)
class Group:
    """A rule over several flags, checked after parsing (gcloud's argument groups)."""

    names: tuple[str, ...]
    kind: str  # "at_most_one" | "one_required" (at least one given) | "needs" (names[0] needs the others)
    message: str  # the real CLI's message when the rule is broken


@dataclasses.dataclass(frozen=True)
class Form:
    path: tuple[str, ...]  # e.g. ("compute", "tpus", "tpu-vm", "create")
    positionals: tuple[str, ...]  # names; a trailing "..." makes the one before it variadic (1 or more)
    flags: tuple[Flag, ...] = ()
    groups: tuple[Group, ...] = ()


@dataclasses.dataclass
class Parsed:
    form: Form
    positionals: list[str]
    flags: dict[str, object]  # name -> value (True for switches; a list for repeatable flags)

    def get(self, name: str, default: object = None) -> object:
        return self.flags.get(name, default)


ZONE = Flag("zone")  # no default zone is configured: a missing one is an error after parsing (exit 1)
GLOBAL = (
    Flag("project", pattern=r"([a-z][-a-z0-9.]*:)?[a-z][-a-z0-9]{4,28}[a-z0-9]"),
    Flag("quiet", takes_value=False),
    Flag("format"),
    Flag("verbosity", pattern="debug|info|warning|error|critical|none"),
    Flag("account"),
    Flag("log-http", takes_value=False),
)
_SSH_COMMON = (
    ZONE, Flag("worker"), Flag("internal-ip", takes_value=False),  # --worker is checked against the node
    Flag("strict-host-key-checking", pattern="yes|no|ask"), Flag("ssh-key-file"),
)
_DURATION = r"[0-9]+[smhd]"
# Every list command's flags (calliope's ListCommand; `--uri` left out: nothing here asks for it).
_LIST = (Flag("filter"), Flag("limit", pattern=r"[1-9][0-9]*|unlimited"), Flag("page-size", pattern=r"[1-9][0-9]*"),
         Flag("sort-by"))
_NAME = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"
# Placement and network flags both create commands take (gcloud 528).
_NETWORK_FLAGS = (
    Flag("network"), Flag("subnetwork"), Flag("service-account"), Flag("scopes"),
    Flag("tags", pattern=rf"{_NAME}(,{_NAME})*"), Flag("labels"), Flag("metadata"), Flag("data-disk", repeat=True),
    Flag("internal-ips", takes_value=False),
)
_NODES = "Exactly one of (--node-id | [--node-count : --node-prefix]) must be specified."
_NODES_TWICE = "argument --node-id: At most one of --node-id | --node-count --node-prefix can be specified."
_TPU_VM = ("compute", "tpus", "tpu-vm")
_QUEUED = ("compute", "tpus", "queued-resources")
FORMS = (
    Form((*_TPU_VM, "create"), ("NAME",), (
        ZONE, Flag("accelerator-type"), Flag("version", required=True),  # the type defaults to v2-8
        Flag("spot", takes_value=False), Flag("preemptible", takes_value=False), Flag("reserved", takes_value=False),
        Flag("description"), *_NETWORK_FLAGS, Flag("async", takes_value=False),
    )),
    Form((*_TPU_VM, "describe"), ("NAME",), (ZONE,)),
    Form((*_TPU_VM, "delete"), ("NAME",), (ZONE, Flag("async", takes_value=False))),
    Form((*_TPU_VM, "list"), (), (ZONE, *_LIST)),
    Form((*_TPU_VM, "accelerator-types", "list"), (), (ZONE, *_LIST)),
    Form((*_TPU_VM, "versions", "list"), (), (ZONE, *_LIST)),
    Form((*_TPU_VM, "ssh"), ("NAME",), (*_SSH_COMMON, Flag("command"), Flag("ssh-flag", repeat=True))),
    Form((*_TPU_VM, "scp"), ("SRC", "...", "DEST"), (
        *_SSH_COMMON, Flag("recurse", takes_value=False), Flag("compress", takes_value=False),
        Flag("scp-flag", repeat=True),
    )),
    Form((*_QUEUED, "create"), ("QUEUED_RESOURCE",), (
        ZONE, Flag("node-id"), Flag("node-count", pattern="[1-9][0-9]*"), Flag("node-prefix", pattern=_NAME),
        Flag("accelerator-type", required=True, missing="Exactly one of (--accelerator-type | --topology --type) "
             "must be specified."),
        Flag("runtime-version", required=True), Flag("spot", takes_value=False),
        Flag("guaranteed", takes_value=False), Flag("reserved", takes_value=False),
        Flag("valid-until-duration", pattern=_DURATION, bad_value_exit=1),
        Flag("valid-after-duration", pattern=_DURATION, bad_value_exit=1), *_NETWORK_FLAGS,
        Flag("async", takes_value=False),
    ), (  # gcloud's argument-group messages; --node-count without --node-prefix is refused as FACTS.md lists
        Group(("node-id", "node-count"), "one_required", _NODES),
        Group(("node-id", "node-count"), "at_most_one", _NODES_TWICE),
        Group(("node-id", "node-prefix"), "at_most_one", _NODES_TWICE),
        Group(("node-count", "node-prefix"), "needs", "argument --node-prefix: Must be specified."),
        Group(("node-prefix", "node-count"), "needs", "argument --node-count: Must be specified."),
        Group(("spot", "guaranteed", "reserved"), "at_most_one",
              "argument --guaranteed: At most one of --guaranteed | --reserved | --spot can be specified."),
    )),
    Form((*_QUEUED, "describe"), ("QUEUED_RESOURCE",), (ZONE,)),
    Form((*_QUEUED, "delete"), ("QUEUED_RESOURCE",), (
        ZONE, Flag("force", takes_value=False), Flag("async", takes_value=False))),
    Form((*_QUEUED, "list"), (), (ZONE, *_LIST)),
    Form(("auth", "configure-docker"), ("REGISTRIES",), (Flag("include-artifact-registry", takes_value=False),)),
    Form(("auth", "list"), (), (Flag("filter-account"), *_LIST)),
    Form(("config", "get-value"), ("SECTION/PROPERTY",)),
)
# Real commands this simulator does not model: refused with a message that says so.
NOT_SIMULATED = {
    _TPU_VM: ("start", "stop", "update", "attach-disk", "detach-disk", "simulate-maintenance-event",
              "get-guest-attributes", "service-identity"),
    (*_TPU_VM, "accelerator-types"): ("describe",),
    (*_TPU_VM, "versions"): ("describe",),
    _QUEUED: ("reset",),
    ("auth",): ("login", "revoke", "activate-service-account", "print-access-token", "print-identity-token",
                "application-default"),
    ("config",): ("set", "unset", "get", "list", "configurations"),
}


def _groups() -> dict[tuple[str, ...], set[str]]:
    """Every group path -> its child names (command groups and commands)."""
    children: dict[tuple[str, ...], set[str]] = {}
    for path in [f.path for f in FORMS] + [(*g, c) for g, cs in NOT_SIMULATED.items() for c in cs]:
        for i in range(len(path)):
            children.setdefault(path[:i], set()).add(path[i])
    return children


def parse(argv: list[str]) -> Parsed:
    """argv after "gcloud" -> Parsed; UsageError for anything the simulator does not accept."""
    children = _groups()
    path: tuple[str, ...] = ()
    rest = list(argv)
    while path in children and rest and not rest[0].startswith("-"):
        word = rest.pop(0)
        if word not in children[path]:
            raise UsageError(path, f"Invalid choice: '{word}'. Valid choices: {', '.join(sorted(children[path]))}.")
        path = (*path, word)
    if path in children:
        raise UsageError(path, f"Command name argument expected (one of {', '.join(sorted(children[path]))}).")
    form = next((f for f in FORMS if f.path == path), None)
    if form is None:
        raise UsageError(path, "this command exists in gcloud but the simulator does not model it")
    return _parse_args(form, rest)


def _parse_args(form: Form, rest: list[str]) -> Parsed:
    known = {f.name: f for f in (*form.flags, *GLOBAL)}
    flags: dict[str, object] = {}
    positionals: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        i += 1
        if word == "-q":
            word = "--quiet"
        if not word.startswith("--") or word == "--":
            if word == "--":
                unknown += rest[i - 1:]
                break
            positionals.append(word)
            continue
        name, has_value, value = word[2:].partition("=")
        flag = known.get(name)
        if flag is None:
            unknown.append(word)
            continue
        if not flag.takes_value:
            if has_value:
                raise UsageError(form.path, f"argument --{name}: ignored explicit argument '{value}'")
            flags[name] = True
            continue
        if not has_value:
            if i >= len(rest):
                raise UsageError(form.path, f"argument --{name}: expected one argument")
            value = rest[i]
            i += 1
        if flag.pattern and not re.fullmatch(flag.pattern, value):
            if flag.bad_value_exit != USAGE_EXIT:
                raise UsageError((), f"Bad value [{value}] for --{name}", code=flag.bad_value_exit)
            raise UsageError(form.path, f"argument --{name}: Bad value [{value}]")
        if flag.repeat:
            flags.setdefault(name, []).append(value)  # type: ignore[union-attr]
        elif name in flags:
            raise UsageError(form.path, f"argument --{name}: given more than once")
        else:
            flags[name] = value
    if unknown:
        raise UsageError(form.path, f"unrecognized arguments: {' '.join(unknown)}")
    _check_positionals(form, positionals)
    for flag in form.flags:
        if flag.required and flag.name not in flags:
            raise UsageError(form.path, flag.missing or f"argument --{flag.name}: Must be specified.")
    for group in form.groups:
        _check_group(form, group, flags)
    return Parsed(form, positionals, flags)


def _check_group(form: Form, group: Group, flags: dict[str, object]) -> None:
    given = [n for n in group.names if n in flags]
    if group.kind == "one_required":
        broken = not given
    elif group.kind == "at_most_one":
        broken = len(given) > 1
    else:  # "needs"
        broken = group.names[0] in flags and not all(n in flags for n in group.names[1:])
    if broken:
        raise UsageError(form.path, group.message)


def _check_positionals(form: Form, positionals: list[str]) -> None:
    required = [n for n in form.positionals if n != "..."]
    if len(positionals) < len(required):
        raise UsageError(form.path, f"argument {' '.join(required[len(positionals):])}: Must be specified.")
    if "..." not in form.positionals and len(positionals) > len(required):
        raise UsageError(form.path, f"unrecognized arguments: {' '.join(positionals[len(required):])}")
