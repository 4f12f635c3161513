"""Where a test run's time went, per test: `python -m tests.costs RUN.xml [--top 30] [--by cpu|wall]`.

RUN.xml is pytest's `--junitxml` of a run (make test-local PYTEST_ARGS="--junitxml=RUN.xml"): each test's wall
time (setup, call and teardown) and, from tests/conftest.py's `test_cpu_s` property, the CPU its pytest process and
every process it started spent, warm children included. Prints each tier's sums and the costliest tests as a
markdown table (docs/tests.md keeps one before and one after a change)."""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    test: str  # tests/TIER/FILE.py::NAME
    wall: float
    cpu: float

    @property
    def tier(self) -> str:
        parts = self.test.split("/")
        return parts[1] if len(parts) > 2 else "tests"


def read(path: str) -> list[Cost]:
    """Every test case of a junit XML file, its CPU summed over the phases' `cpu_s` properties."""
    costs = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = case.get("name", "")
        cpu = sum(float(p.get("value", 0)) for p in case.iter("property") if p.get("name") == "test_cpu_s")
        costs.append(Cost(f"{module}.py::{name}", float(case.get("time", 0)), cpu))
    return costs


def table(costs: list[Cost], *, top: int, by: str) -> str:
    tiers: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for cost in costs:
        tiers[cost.tier][0] += cost.wall
        tiers[cost.tier][1] += cost.cpu
        tiers[cost.tier][2] += 1
    lines = ["| tier | tests | wall (summed) | CPU |", "|---|---|---|---|"]
    for tier, (wall, cpu, count) in sorted(tiers.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {tier} | {count} | {wall:.0f} s | {cpu:.0f} s |")
    lines += ["", "| test | wall | CPU |", "|---|---|---|"]
    for cost in sorted(costs, key=lambda c: -getattr(c, by))[:top]:
        lines.append(f"| `{cost.test}` | {cost.wall:.1f} s | {cost.cpu:.1f} s |")
    return "\n".join(lines)


def print_costs(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("xml")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--by", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args(argv)
    print(table(read(args.xml), top=args.top, by=args.by))
    return 0


if __name__ == "__main__":
    sys.exit(print_costs())
