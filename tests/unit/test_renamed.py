"""A renamed public value answers to its old name (job/core/renamed.py): the same object, a DeprecationWarning
naming the new name, and any other unknown name still an AttributeError."""

from __future__ import annotations

import importlib
import re

import pytest

from job.core import renamed

# (module, old name, new name: the module's own, or the dotted path of a value that lives elsewhere)
RENAMED = [
    ("job.tasks.lm.model", "REMAT_POLICIES", "job.kernels.rematerialize.POLICIES"),
    ("job.train.remat_auto", "HEADROOM", "DEVICE_SHARE"),
    ("job.runs.local_transport", "HEADROOM", "ROOM_FACTOR"),
    ("job.runs.local_tier", "Plan", "RestorePlan"),
    ("job.runs.local_tier", "choose", "plan_restore"),
    ("job.parallel.annotations", "KINDS", "VARIABLE_KINDS"),
    ("job.train.fit", "KINDS", "REMEDY_KINDS"),
    ("deploy.row_contract", "PARTS", "PROCESS_COUNTS"),
]


@pytest.mark.parametrize(("module", "old", "new"), RENAMED)
def test_an_old_name_gives_the_new_ones_value_with_a_warning_naming_it(module: str, old: str, new: str) -> None:
    imported = importlib.import_module(module)
    where, _, name = new.rpartition(".") if "." in new else (module, ".", new)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{module}.{old} is now {where}.{name}")):
        value = getattr(imported, old)
    assert value is getattr(importlib.import_module(where), name)
    assert old not in vars(imported) and old not in imported.__all__, "one definition, under the new name"
    assert name in getattr(importlib.import_module(where), "__all__", [name])


def test_a_name_that_never_was_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'job.train.remat_auto' has no attribute 'HEADROM'"):
        importlib.import_module("job.train.remat_auto").HEADROM  # noqa: B018
    answer = renamed.answer("job.core.renamed", {"OLD": "answer"})
    with pytest.warns(DeprecationWarning, match="job.core.renamed.OLD is now job.core.renamed.answer"):
        assert answer("OLD") is renamed.answer
