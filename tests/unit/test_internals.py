"""job.core.internals: every private name of another library the job uses is still there, and no other
module of the job reaches one itself."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

from job.core import internals

ROOT = Path(__file__).resolve().parents[2]
# What only internals.py may write: a private module path, or a private name listed there (Python's atexit's too).
PRIVATE_TEXT = re.compile(r"\b(?:jax|orbax|tensorstore|submitit)(?:\.\w+)*\._[a-z]\w*|\bts_pool_worker\b|\b_thread_func\b"
                          r"|\batexit\._\w+|\b_run_exitfuncs\b|\bunittest\.mock\b|from unittest import mock")

# The tests' own stand-ins that reach inside another library, by file: a fault injected into orbax's commit of
# a save, jax's distributed runtime replaced by inert objects so that GPU layouts can be initialised on one
# machine. Looked up like internals.PRIVATE, so a version bump fails here, naming them; no other test file
# reaches a private name (what job.core.internals offers, they take from it).
TESTS_REACH = {
    # orbax-checkpoint 0.12.8
    "tests/gcs/kill_in_commit.py": ("orbax.checkpoint._src.path.atomicity:CommitFileTemporaryPath.finalize",),
    # jax 0.10.2, 0.12.0.1
    "tests/unit/test_effective_devices.py": ("jax._src.distributed:_jax.get_distributed_runtime_service",
                                             "jax._src.distributed:_jax.get_distributed_runtime_client",
                                             "jax._src.distributed:_jax.create_preemption_sync_manager"),
    # jax 0.10.2, 0.12.0.1: the tests' shared compilation cache keys
    "tests/site/sitecustomize.py": ("jax._src.cache_key:_hash_accelerator_config",
                                    "jax._src.cache_key:_hash_devices"),
}
LIBRARY_PRIVATE = re.compile(r"\b(?:jax|orbax|tensorstore|submitit)(?:\.\w+)*\._[a-z]\w*")


@pytest.mark.parametrize("name", [*internals.PRIVATE, *(name for names in TESTS_REACH.values() for name in names)])
def test_every_private_name_is_still_in_the_installed_library(name: str) -> None:
    try:
        internals.lookup(name)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{name}: expected it in the installed library (jax {jax.__version__}), found it gone "
                    f"({exc!r}). Fix: find what replaced it and update job/core/internals.py", pytrace=False)


def test_each_private_name_says_the_versions_it_was_checked_against() -> None:
    text = (ROOT / "job" / "core" / "internals.py").read_text()
    for name in internals.PRIVATE:
        before = text[:text.index(f'"{name}"') if f'"{name}"' in text else text.index(name.split(":")[1])]
        comment = before.rstrip().rsplit("\n", 1)[-1]
        while not comment.lstrip().startswith("#"):  # entries grouped under one comment
            before = before.rstrip().rsplit("\n", 1)[0]
            comment = before.rsplit("\n", 1)[-1]
        assert re.search(r"\d+\.\d+\.\d+", comment), f"{name}: its comment names no version: {comment!r}"


def test_no_other_module_reaches_a_private_name() -> None:
    found = []
    for path in sorted(path for top in ("job", "deploy", "bench") for path in (ROOT / top).rglob("*.py")):
        if path == ROOT / "job" / "core" / "internals.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE_TEXT.search(line.split("#", 1)[0]):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "private names outside job/core/internals.py:\n" + "\n".join(found)


def test_no_test_reaches_a_private_name_but_the_stand_ins_listed_here() -> None:
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where == "tests/unit/test_internals.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if LIBRARY_PRIVATE.search(line.split("#", 1)[0]) and where not in TESTS_REACH:
                found.append(f"{where}:{number}: {line.strip()}")
    assert not found, "private names in tests, neither from job.core.internals nor in TESTS_REACH:\n" + "\n".join(found)


def test_the_lookups_answer_in_one_process() -> None:
    assert internals.backends_are_initialized() in (True, False)
    assert internals.coordination_client() is None  # no distributed runtime in the unit tier
    assert internals.in_cloud_tpu_vm() is False
    code = internals.lookup(next(n for n in internals.PRIVATE if n.endswith(internals.ORBAX_SAVE_THREAD_FUNCTION)))
    assert internals.is_orbax_save_thread(code.__code__)
    assert not internals.is_orbax_save_thread(test_the_lookups_answer_in_one_process.__code__)


def test_the_one_host_view_is_undone_on_exit() -> None:
    devices = jax.local_devices()
    from orbax.checkpoint._src.multihost import multihost

    before = multihost.should_skip_process_sync
    with internals.one_host_view(devices[:1]):
        assert jax.process_index() == 0 and jax.process_count() == 1 and jax.devices() == devices[:1]
        assert multihost.should_skip_process_sync() is True
    assert multihost.should_skip_process_sync is before and jax.devices() == devices
