"""What a Slurm cluster offers (its partitions and their nodes), and the quick checks of a request against it.

    cluster = read(cfg, runner)    # scontrol show partition (all, hidden ones too); sinfo of the partition's nodes
    for name, check in QUICK:      # each returns what it found, or raises ConfigError naming the make variable
        check(cfg, cluster)

This is the part of `make doctor` that `make submit-slurm` runs before it queues anything
(`deploy.slurm.submit.validate`): two read-only commands, no job. What each check catches:

| check            | fails when                                                                   |
|------------------|------------------------------------------------------------------------------|
| partition        | PARTITION is not one (or, unset, the cluster has no default); it is not UP   |
| access           | ACCOUNT or QOS is not among the partition's AllowAccounts / AllowQos          |
| GPUs per node    | no node of the partition has GPUS_PER_NODE GPUs (of GPU_TYPE)                 |
| CPUs per node    | no node has TASKS_PER_NODE x CPUS_PER_TASK CPUs                               |
| memory per node  | no node has MEM                                                               |
| nodes            | fewer than NODES such nodes, over the partition's MaxNodes, or some are down |
| time limit       | TIME over the partition's MaxTime                                            |
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from collections.abc import Callable, Sequence

from deploy.runner import Runner
from deploy.slurm.options import SlurmConfig, duration_seconds, time_minutes
from job.errors import ConfigError

UNLIMITED = ("UNLIMITED", "INFINITE")  # how Slurm spells "no limit" (scontrol; slurm.conf takes both)
# Node states (sinfo %T, lower case) that take no new job: the job would wait until an admin brings them back.
# A '*' suffix means not responding; '~' (powered off, booted on demand) and the rest take jobs.
UNAVAILABLE = ("down", "drain", "drained", "draining", "fail", "failing", "inval", "future", "unknown")
# Node states whose slurmd does not answer the controller: it died (down, after SlurmdTimeout) or never
# registered (unknown); a '*' suffix (not responding) says the same sooner. Drained is an admin's choice.
NO_ANSWER = ("down", "unknown")
PARTITION_ARGV = ("scontrol", "--all", "--oneliner", "show", "partition")
NODE_FORMAT = "%N|%T|%c|%m|%G"  # name, state, CPUs, memory (MB), GRES
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:.]*)=")  # a key of scontrol's one-line KEY=VALUE form
_MEM = re.compile(r"([0-9]+)([KMGTkmgt]?)")
_KIB = {"K": 1, "": 1024, "M": 1024, "G": 1024**2, "T": 1024**3}  # a --mem suffix (none: MB) in KiB
# what a Slurm command (scontrol, sinfo, sbatch) says where no controller answers
NO_CONTROLLER = ("Could not establish a configuration source", "Unable to contact slurm controller")


@dataclasses.dataclass(frozen=True)
class Partition:
    name: str
    state: str  # UP, DOWN, DRAIN or INACTIVE
    default: bool  # the partition a job without --partition goes to
    hidden: bool  # Hidden=YES: sinfo leaves it out, jobs may still ask for it
    max_time: str  # as scontrol prints it: 7-00:00:00, UNLIMITED
    default_time: str  # NONE (then MaxTime applies), or a time
    max_nodes: int | None  # None: UNLIMITED
    min_nodes: int
    allow_accounts: tuple[str, ...] | None  # None: ALL
    allow_qos: tuple[str, ...] | None  # None: ALL


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    state: str  # sinfo %T: idle, mixed, allocated, down*, drained, ...
    cpus: int
    memory_mb: int  # RealMemory
    gpus: tuple[tuple[str | None, int], ...]  # (type or None, count) per gpu GRES entry

    @property
    def base_state(self) -> str:
        """The state without sinfo's flag suffixes and added states: 'idle*' -> 'idle', 'down+drain' -> 'down'."""
        return self.state.rstrip("*~#%$@!^-+").split("+")[0]

    @property
    def available(self) -> bool:
        """Takes new jobs (busy is fine: a job waits its turn; down or drained waits for an admin)."""
        return not self.state.endswith("*") and self.base_state not in UNAVAILABLE

    @property
    def answers(self) -> bool:
        """Its slurmd answers the controller: not marked not responding ('*'), not down, not unknown."""
        return not self.state.endswith("*") and self.base_state not in NO_ANSWER

    def said(self) -> str:
        """'node3 (idle*: not responding)', 'node4 (down)': the node and its state, for a message."""
        return f"{self.name} ({self.state}{': not responding' if self.state.endswith('*') else ''})"

    def gpu_count(self, kind: str | None) -> int:
        return sum(n for t, n in self.gpus if kind is None or t == kind)


@dataclasses.dataclass(frozen=True)
class Cluster:
    partitions: tuple[Partition, ...]  # every partition, hidden ones too
    partition: Partition  # the one the job goes to (PARTITION, else the default)
    nodes: tuple[Node, ...]  # that partition's nodes


def limit_minutes(text: str) -> int | None:
    """A partition's MaxTime / DefaultTime as scontrol prints it -> whole minutes; None for no limit.

    Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; UNLIMITED or INFINITE (and
    DefaultTime's NONE) mean no limit. Anything else is a ValueError: scontrol said something unexpected.
    """
    if text.upper() in (*UNLIMITED, "NONE"):
        return None
    seconds = duration_seconds(text)
    if seconds is None:
        raise ValueError(f"not a Slurm time limit: {text!r}")
    return -(-seconds // 60)


def key_values(line: str) -> dict[str, str]:
    """One line of `scontrol --oneliner show ...` -> {key: value}; a value may hold spaces (Reason=, OS=)."""
    keys = list(_KEY.finditer(line))
    return {m.group(1): line[m.end():keys[i + 1].start() if i + 1 < len(keys) else len(line)].strip()
            for i, m in enumerate(keys)}


def _names(value: str) -> tuple[str, ...] | None:
    return None if value in ("", "ALL") else tuple(v for v in value.split(",") if v)


def parse_partitions(text: str) -> tuple[Partition, ...]:
    """`scontrol --all --oneliner show partition` -> every partition."""
    found = []
    for line in text.splitlines():
        kv = key_values(line.strip())
        if "PartitionName" not in kv:
            continue
        max_nodes = kv.get("MaxNodes", "UNLIMITED")
        found.append(Partition(
            name=kv["PartitionName"], state=kv.get("State", "UP").upper(), default=kv.get("Default") == "YES",
            hidden=kv.get("Hidden") == "YES", max_time=kv.get("MaxTime", "UNLIMITED"),
            default_time=kv.get("DefaultTime", "NONE"),
            max_nodes=None if max_nodes.upper() in UNLIMITED else int(max_nodes),
            min_nodes=int(kv.get("MinNodes", "0") or 0),
            allow_accounts=_names(kv.get("AllowAccounts", "ALL")), allow_qos=_names(kv.get("AllowQos", "ALL")),
        ))
    return tuple(found)


def parse_gres(text: str) -> tuple[tuple[str | None, int], ...]:
    """sinfo's %G -> the gpu entries: 'gpu:4' -> ((None, 4),); 'gpu:a100:4(S:0-1),gpu:v100:2' -> a100 and v100."""
    gpus = []
    for entry in re.split(r",(?![^(]*\))", text):  # commas outside a (S:0,1) socket list
        parts = entry.split("(")[0].split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        count = re.match(r"[0-9]+", parts[-1])
        if count:
            gpus.append((parts[1] if len(parts) > 2 else None, int(count.group())))
    return tuple(gpus)


def parse_nodes(text: str) -> tuple[Node, ...]:
    """`sinfo --noheader --Node --partition P --format '%N|%T|%c|%m|%G'` -> the partition's nodes."""
    nodes = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, state, cpus, memory, gres = fields
        nodes[name] = Node(name, state.lower(), int(cpus.rstrip("+") or 0), int(memory.rstrip("+") or 0),
                           parse_gres(gres))
    return tuple(nodes.values())


def mem_mb(text: str) -> int:
    """Slurm's --mem (a number of MB, or with a K/M/G/T suffix) -> MB, rounded up."""
    m = _MEM.fullmatch(text)
    if not m:
        raise ValueError(f"not a Slurm memory size: {text!r}")
    return -(-int(m.group(1)) * _KIB[m.group(2).upper()] // 1024)


def _query(argv: Sequence[str], runner: Runner) -> str:
    """A read-only Slurm query's stdout, or one ConfigError: no controller, or what the command said."""
    try:
        return runner.run(list(argv), capture=True, mutating=False, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(argv[0], expected=f"{argv[0]} to answer", found=str(exc),
                          fix="run this on the cluster's login node (Slurm's commands on PATH)") from None
    except subprocess.CalledProcessError as exc:
        lines = [line.strip() for line in f"{exc.stderr or ''}\n{exc.output or ''}".splitlines() if line.strip()]
        for line in lines:
            if any(sign in line for sign in NO_CONTROLLER):
                raise ConfigError("Slurm", expected=f"a Slurm controller that {argv[0]} can reach", found=line,
                                  fix="run this on the cluster's login node, or start the local cluster: "
                                      "`make slurm-up NODES=4`") from None
        said = " | ".join(lines) or f"exit {exc.returncode}"
        raise ConfigError("Slurm", expected=f"`{' '.join(argv)}` to answer", found=said,
                          fix="see what Slurm said; `make doctor` checks the rest") from None


def listed(partitions: Sequence[Partition]) -> str:
    """The partitions sinfo shows (not the hidden ones), the default marked as sinfo marks it."""
    return ", ".join(p.name for p in partitions if not p.hidden) or "none"


def read(cfg: SlurmConfig, runner: Runner) -> Cluster:
    """The partitions, the one the job goes to and its nodes; ConfigError when it does not exist."""
    partitions = parse_partitions(_query(PARTITION_ARGV, runner))
    if cfg.partition is None:
        chosen = next((p for p in partitions if p.default), None)
        if chosen is None:
            raise ConfigError("PARTITION", expected="a partition: this cluster has no default one",
                              found="PARTITION unset", fix=f"PARTITION=... (one of {listed(partitions)})")
    else:
        chosen = next((p for p in partitions if p.name == cfg.partition), None)
        if chosen is None:
            raise ConfigError("PARTITION", expected=f"one of {listed(partitions)}", found=cfg.partition,
                              fix="pick a listed partition (sinfo shows them) or leave PARTITION unset")
    nodes = parse_nodes(_query(["sinfo", "--noheader", "--Node", "--partition", chosen.name, "--format",
                                NODE_FORMAT], runner))
    return Cluster(partitions, chosen, nodes)


def _named(cfg: SlurmConfig, cluster: Cluster) -> str:
    return cluster.partition.name + ("" if cfg.partition else " (the default)")


def partition_up(cfg: SlurmConfig, cluster: Cluster) -> str:
    p = cluster.partition
    if p.state != "UP":
        up = [q.name for q in cluster.partitions if q.state == "UP" and not q.hidden]
        raise ConfigError("PARTITION", expected="a partition in state UP (DOWN queues jobs that never start, DRAIN "
                          "and INACTIVE refuse them)", found=f"{p.name}, which is {p.state}",
                          fix=f"PARTITION={up[0] if up else '...'} ({', '.join(up) or 'no partition'} UP), or ask "
                              f"the admins when {p.name} comes back")
    return f"{_named(cfg, cluster)} is UP, {len(cluster.nodes)} node(s)"


def access(cfg: SlurmConfig, cluster: Cluster) -> str:
    p = cluster.partition
    for what, value, allowed, key in (("ACCOUNT", cfg.account, p.allow_accounts, "AllowAccounts"),
                                      ("QOS", cfg.qos, p.allow_qos, "AllowQos")):
        if value is not None and allowed is not None and value not in allowed:
            raise ConfigError(what, expected=f"one of partition {p.name}'s {key} ({', '.join(allowed)})",
                              found=value, fix=f"{what}={allowed[0]}, or a PARTITION that allows {value}")
    return f"{p.name} takes ACCOUNT={cfg.account or '(yours)'} QOS={cfg.qos or '(default)'}"


def _gpus_wanted(cfg: SlurmConfig) -> str:
    return f"{cfg.gpus_per_node}" + (f" {cfg.gpu_type}" if cfg.gpu_type else "")


def gpus(cfg: SlurmConfig, cluster: Cluster) -> str:
    if not cfg.gpus_per_node:
        return "none asked (GPUS_PER_NODE unset)"
    most = max((n.gpu_count(cfg.gpu_type) for n in cluster.nodes), default=0)
    if most < cfg.gpus_per_node:
        kind = f"{cfg.gpu_type} GPUs" if cfg.gpu_type else "GPUs"
        types = sorted({t for n in cluster.nodes for t, _ in n.gpus if t})
        hint = f" (GPU types there: {', '.join(types)})" if cfg.gpu_type and types else ""
        raise ConfigError("GPUS_PER_NODE", expected=f"at most {most}: the most {kind} a node of partition "
                          f"{cluster.partition.name} has{hint}", found=_gpus_wanted(cfg),
                          fix=f"GPUS_PER_NODE={most}" if most else "a PARTITION with GPU nodes (sinfo -o '%P %G')")
    return f"{_gpus_wanted(cfg)} asked, nodes of {cluster.partition.name} have up to {most}"


def _cpus_wanted(cfg: SlurmConfig) -> int:
    return cfg.ntasks_per_node * (cfg.cpus_per_task or 1)


def cpus(cfg: SlurmConfig, cluster: Cluster) -> str:
    wanted, most = _cpus_wanted(cfg), max((n.cpus for n in cluster.nodes), default=0)
    if wanted > most:
        raise ConfigError("CPUS_PER_TASK", expected=f"TASKS_PER_NODE x CPUS_PER_TASK at most {most}, the most CPUs "
                          f"a node of partition {cluster.partition.name} has",
                          found=f"{cfg.ntasks_per_node} x {cfg.cpus_per_task or 1} = {wanted}",
                          fix=f"CPUS_PER_TASK={max(most // cfg.ntasks_per_node, 1)} or less")
    return f"{cfg.ntasks_per_node} task(s) x {cfg.cpus_per_task or 1} CPU(s) per node, nodes have up to {most}"


def memory(cfg: SlurmConfig, cluster: Cluster) -> str:
    most = max((n.memory_mb for n in cluster.nodes), default=0)
    if cfg.mem is None or mem_mb(cfg.mem) == 0:
        return f"MEM {'0 (all of it)' if cfg.mem else 'unset'}, nodes have up to {most} MB"
    if mem_mb(cfg.mem) > most:
        raise ConfigError("MEM", expected=f"at most {most}M, the most memory (RealMemory) a node of partition "
                          f"{cluster.partition.name} has", found=cfg.mem, fix=f"MEM={most}M or less, or MEM=0 (all)")
    return f"MEM={cfg.mem} asked, nodes have up to {most} MB"


def _fits(cfg: SlurmConfig, node: Node) -> bool:
    return (node.gpu_count(cfg.gpu_type) >= cfg.gpus_per_node and node.cpus >= _cpus_wanted(cfg)
            and (cfg.mem is None or node.memory_mb >= mem_mb(cfg.mem)))


def node_count(cfg: SlurmConfig, cluster: Cluster) -> str:
    p, want = cluster.partition, cfg.allocated_nodes
    name = "NODES+SPARES" if cfg.spares else "NODES"  # a fix names NODES: the spares are what it leaves
    fit = [n for n in cluster.nodes if _fits(cfg, n)]
    such = " such" if len(fit) < len(cluster.nodes) else ""
    others = [q.name for q in cluster.partitions if q is not p and not q.hidden and q.state == "UP"]
    elsewhere = f"another PARTITION ({', '.join(others)})" if others else "another PARTITION"
    if p.max_nodes is not None and want > p.max_nodes:
        raise ConfigError(name, expected=f"at most partition {p.name}'s MaxNodes {p.max_nodes}", found=want,
                          fix=f"NODES={p.max_nodes - cfg.spares}, or a PARTITION with a larger MaxNodes")
    if want < p.min_nodes:
        raise ConfigError(name, expected=f"at least partition {p.name}'s MinNodes {p.min_nodes}", found=want,
                          fix=f"NODES={p.min_nodes - cfg.spares}")
    if not fit and len(cluster.nodes) >= want:  # the per-node checks above said which resource no node has
        return f"{want} asked, partition {p.name} has {len(cluster.nodes)} node(s), none with the per-node request"
    if want > len(fit):
        raise ConfigError(name, expected=f"at most {len(fit)}: partition {p.name} has {len(fit)}{such} node(s)"
                          + (f" of {len(cluster.nodes)} (with the GPUs, CPUs and memory asked)" if such else ""),
                          found=want, fix=(f"NODES={len(fit) - cfg.spares}, or " if len(fit) > cfg.spares else "") + elsewhere)
    up = [n for n in fit if n.available]
    if want > len(up):
        out = ", ".join(f"{n.name} ({n.state})" for n in fit if not n.available)
        raise ConfigError(name, expected=f"at most {len(up)}: the{such} nodes of partition {p.name} that take "
                          "jobs (the job would wait in the queue until the others come back)", found=want,
                          fix=(f"NODES={len(up) - cfg.spares}, " if len(up) > cfg.spares else "") + f"{elsewhere}, or wait until the admins "
                              f"resume {out}")
    return f"{want} asked, partition {p.name} has {len(up)}{such} node(s) taking jobs"


def time_limit(cfg: SlurmConfig, cluster: Cluster) -> str:
    p = cluster.partition
    limit = limit_minutes(p.max_time)
    default = "" if p.default_time.upper() == "NONE" else f", DefaultTime {p.default_time}"
    if limit is not None and time_minutes(cfg.time) > limit:
        longer = [q.name for q in cluster.partitions if q is not p and not q.hidden and q.state == "UP"
                  and (limit_minutes(q.max_time) or 1 << 62) >= time_minutes(cfg.time)]
        raise ConfigError("TIME", expected=f"at most partition {p.name}'s MaxTime {p.max_time}", found=cfg.time,
                          fix=f"TIME={p.max_time} or less (the job saves and requeues itself at its limit)"
                              + (f", or PARTITION={longer[0]} (MaxTime long enough: {', '.join(longer)})"
                                 if longer else ""))
    return f"TIME={cfg.time} within {p.name}'s MaxTime {p.max_time}{default}"


QuickCheck = Callable[[SlurmConfig, Cluster], str]
# (name, check) in the order `make doctor` prints them; the first failure is what make submit-slurm says
QUICK: tuple[tuple[str, QuickCheck], ...] = (
    ("partition", partition_up), ("access", access), ("GPUs per node", gpus), ("CPUs per node", cpus),
    ("memory per node", memory), ("nodes", node_count), ("time limit", time_limit),
)


def require(cfg: SlurmConfig, runner: Runner) -> Cluster:
    """Every quick check; the first failure as its ConfigError (what `make submit-slurm` runs)."""
    cluster = read(cfg, runner)
    for _, check in QUICK:
        check(cfg, cluster)
    return cluster
