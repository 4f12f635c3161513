"""Slurm hostlist expansion (`job.runtime.cluster.nodelist`), checked against `scontrol show hostnames`."""

from __future__ import annotations

import pytest

from job.errors import ConfigError
from job.runtime.cluster.nodelist import (
    expand_nodelist,
    expand_tasks_per_node,
    first_node,
)

# (id, hostlist, hosts in Slurm's order) - what `scontrol show hostnames` prints.
NODELISTS: tuple[tuple[str, str, list[str]], ...] = (
    ("single", "node1", ["node1"]),
    ("range", "node[1-4]", ["node1", "node2", "node3", "node4"]),
    ("padded-list-and-plain", "a[01-03,07],b5", ["a01", "a02", "a03", "a07", "b5"]),
    ("product-leftmost-slowest", "gpu-[1-2]-[3-4]", ["gpu-1-3", "gpu-1-4", "gpu-2-3", "gpu-2-4"]),
    ("padding-kept-across-width", "node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("no-padding", "x[9-11]", ["x9", "x10", "x11"]),
    ("plain-names", "host-a,host-b", ["host-a", "host-b"]),
    ("singles-and-range", "n[1,3,5-6]", ["n1", "n3", "n5", "n6"]),
    ("mixed", "rack1-n[1-2],login", ["rack1-n1", "rack1-n2", "login"]),
    ("suffix-after-bracket", "r[1-2]a", ["r1a", "r2a"]),
    ("zero-start", "c[0-2]", ["c0", "c1", "c2"]),
    ("surrounding-whitespace", " node[1-2]\n", ["node1", "node2"]),
)


@pytest.mark.parametrize(("nodelist", "hosts"), [row[1:] for row in NODELISTS], ids=[row[0] for row in NODELISTS])
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(("nodelist", "hosts"), [row[1:] for row in NODELISTS], ids=[row[0] for row in NODELISTS])
def test_first_node(nodelist: str, hosts: list[str]) -> None:
    assert first_node(nodelist) == hosts[0]


def test_large_range_is_complete_and_ordered() -> None:
    hosts = expand_nodelist("n[0001-1000]")
    assert len(hosts) == 1000
    assert hosts[0] == "n0001" and hosts[-1] == "n1000"
    assert hosts == sorted(hosts)


# (id, malformed hostlist, why the error says it failed)
BAD_NODELISTS: tuple[tuple[str, str, str], ...] = (
    ("unclosed", "node[1-", "unclosed"),
    ("close-without-open", "a]", "without"),
    ("empty", "", "empty"),
    ("blank", "   ", "empty"),
    ("backwards", "node[4-1]", "backwards"),
    ("no-prefix", "[1-2]", "no prefix"),
    ("letters-in-range", "n[a-b]", "is not N or N-M"),
    ("empty-name", "a,,b", "no prefix"),
    ("nested", "n[[1]]", "nested"),
    ("empty-brackets", "n[]", "is not N or N-M"),
    ("trailing-comma", "a,b,", "no prefix"),
)


@pytest.mark.parametrize(("nodelist", "why"), [row[1:] for row in BAD_NODELISTS], ids=[row[0] for row in BAD_NODELISTS])
def test_malformed_nodelist_raises_config_error(nodelist: str, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        expand_nodelist(nodelist)
    message = str(caught.value)
    assert repr(nodelist) in message  # the input, verbatim
    assert why in message
    assert "expected a Slurm hostlist expression" in message
    assert "Fix: " in message and "scontrol show hostnames" in message
    assert caught.value.found == nodelist


@pytest.mark.parametrize(("nodelist", "why"), [row[1:] for row in BAD_NODELISTS], ids=[row[0] for row in BAD_NODELISTS])
def test_first_node_of_malformed_nodelist_raises(nodelist: str, why: str) -> None:
    with pytest.raises(ConfigError, match="Slurm nodelist"):
        first_node(nodelist)


# (id, SLURM_TASKS_PER_NODE, tasks on each node)
TASKS_PER_NODE: tuple[tuple[str, str, list[int]], ...] = (
    ("uniform-one-node", "4", [4]),
    ("repeat-then-single", "2(x3),1", [2, 2, 2, 1]),
    ("list", "1,2", [1, 2]),
    ("repeat-only", "4(x2)", [4, 4]),
    ("two-repeats", "3(x2),1(x3)", [3, 3, 1, 1, 1]),
)


@pytest.mark.parametrize(("spec", "counts"), [row[1:] for row in TASKS_PER_NODE], ids=[row[0] for row in TASKS_PER_NODE])
def test_expand_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "two", "2(x)", "2(3)", "2(x3", "2,,1", "-1"])
def test_malformed_tasks_per_node_raises(spec: str) -> None:
    with pytest.raises(ConfigError) as caught:
        expand_tasks_per_node(spec)
    message = str(caught.value)
    assert "SLURM_TASKS_PER_NODE" in message
    assert repr(spec) in message
    assert "expected counts such as" in message and "Fix: " in message
