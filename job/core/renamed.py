"""The old names of a module's public values: each still importable, with a DeprecationWarning naming its new
one, as a moved module's old path is (docs/api.md).

    __getattr__ = renamed.answer(__name__, {"HEADROOM": "DEVICE_SHARE"})      # at the module's end

Python asks a module's `__getattr__` only for a name the module does not define, so a renamed value has one
definition, under its new name, and the old name reads it from there.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def answer(module: str, old_names: Mapping[str, str]) -> Callable[[str], Any]:
    """A `__getattr__` for `module` that answers each old name of `old_names` (old -> new: a name of `module`,
    or the dotted path of a value that lives elsewhere now) with the new name's value and a DeprecationWarning
    naming it; any other name is an AttributeError, as it is without one."""

    def __getattr__(name: str) -> Any:
        if name not in old_names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new = old_names[name]
        where, _, attribute = new.rpartition(".") if "." in new else (module, ".", new)
        warnings.warn(f"{module}.{name} is now {where}.{attribute}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), attribute)

    return __getattr__


__all__ = ["answer"]
