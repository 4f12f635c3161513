"""No function of job/ or deploy/ runs past LONGEST lines: one that does is split by responsibility into helpers
named for what each does. A function's lines run from its `def` to its last line, docstring included; a function
defined inside another counts within it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONGEST = 60
PACKAGES = ("job", "deploy")


def outer_functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions of a module and its classes (methods included), not those defined inside a function."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        else:
            yield from outer_functions(node)


def lines_of(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return (function.end_lineno or function.lineno) - function.lineno + 1


def long_functions(source: str, name: str) -> list[str]:
    """'PATH:LINE NAME (N lines)' of each function of `source` past LONGEST lines."""
    return [f"{name}:{function.lineno} {function.name} ({lines_of(function)} lines)"
            for function in outer_functions(ast.parse(source, name)) if lines_of(function) > LONGEST]


def test_no_function_of_job_or_deploy_is_longer_than_60_lines() -> None:
    found = [long for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for long in long_functions(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, (f"expected every function of {' and '.join(PACKAGES)} within {LONGEST} lines (its def to its "
                       f"last line), found {found}. Fix: split each by responsibility into helpers named for what "
                       "they do")


def statements(count: int, indent: int) -> str:
    return "".join(f"{' ' * indent}x{n} = {n}\n" for n in range(count))


def test_the_scan_counts_a_function_from_its_def_to_its_last_line_with_its_nested_functions() -> None:
    # def, nested def, its return, the statements, return: LONGEST + 1 lines
    nested = f"def outer():\n    def inner():\n        return 1\n{statements(LONGEST - 3, 4)}    return inner\n"
    assert long_functions(nested, "m.py") == [f"m.py:1 outer ({LONGEST + 1} lines)"]
    within = f"class A:\n    @staticmethod\n    def method():\n{statements(LONGEST - 2, 8)}        return 0\n"
    assert long_functions(within, "m.py") == []  # LONGEST lines: the decorator is not counted
    past = f"class A:\n    def method(self):\n{statements(LONGEST, 8)}\n    def short(self):\n        return 0\n"
    assert long_functions(past, "m.py") == [f"m.py:2 method ({LONGEST + 1} lines)"]
