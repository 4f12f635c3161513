"""remat `auto`'s choice remembered (job/train/remat_cache.py): in the run dir and, keyed by what decides it, in the
compilation cache's folder, where a new run dir of the same step finds it; a record for another step, another
device or of another form is not read; each file written whole; the program a record names is the same for a
fresh trace of the same step."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from etils import epath
from flax import nnx

from job.core import rundir
from job.kernels import rematerialize
from job.runtime.device_memory import Need
from job.tasks.lm import model
from job.train import remat_auto, remat_cache

GIB = 2**30
STEP = {"task": "lm", "model": {"dim": 64, "layers": 2}, "global_batch": 16, "rule": "replicated", "accum_steps": 1,
        "mesh": {"data": 1, "model": 1}, "devices": "1 device (TPU v5 lite)", "limit": 16 * GIB, "jax": "0.10.2",
        "compiler": "libtpu 0.0.1"}


def _choice(policy: str = "dots", available: int | None = 16 * GIB) -> remat_auto.Choice:
    return remat_auto.Choice(policy, step=None, need=Need(True, 9 * GIB, available), tried=(),
                             text=lambda: f"program under {policy}")


def _dirs(tmp_path: Path) -> tuple[epath.Path, epath.Path, str]:
    return epath.Path(tmp_path / "run-a"), epath.Path(tmp_path / "run-b"), str(tmp_path / "cache" / "jax")


def test_a_choice_is_remembered_in_the_run_dir_and_the_cache_and_a_new_run_dir_of_the_same_step_recalls_it(
        tmp_path: Path) -> None:
    run_a, run_b, cache = _dirs(tmp_path)
    remat_cache.remember(run_a, cache, STEP, _choice())
    shared = Path(cache) / remat_cache.FOLDER / f"{remat_cache.key(STEP)}.json"
    own = json.loads(Path(rundir.remat_choice(run_a)).read_text())
    assert own == json.loads(shared.read_text())
    assert own == {"policy": "dots", "program": remat_auto.program_of("program under dots"), "for": STEP,
                   "needed": 9 * GIB, "limit": 16 * GIB, "run_dir": str(run_a)}
    digest = remat_auto.program_of("program under dots")
    assert remat_cache.recall(run_b, cache, STEP) == remat_auto.Remembered("dots", digest, f"an earlier run in {run_a}")
    assert remat_cache.recall(run_a, cache, STEP) == remat_auto.Remembered("dots", digest, "this run's earlier attempt")
    assert remat_cache.recall(run_b, None, STEP) is None  # the compilation cache off: only a run's own record
    assert remat_cache.ran(run_a) == "dots" and remat_cache.ran(run_b) is None
    assert sorted(p.name for p in shared.parent.iterdir()) == [shared.name]  # written whole: no temporary left


@pytest.mark.parametrize("changed", [{"limit": 32 * GIB}, {"devices": "1 device (TPU v6 lite)"},
                                     {"global_batch": 32}, {"model": {"dim": 64, "layers": 4}}, {"jax": "0.11.0"}])
def test_another_device_memory_or_step_is_another_key_so_a_choice_made_where_memory_was_short_is_not_recalled(
        tmp_path: Path, changed: dict) -> None:
    run_a, run_b, cache = _dirs(tmp_path)
    remat_cache.remember(run_a, cache, STEP, _choice("full"))
    other = {**STEP, **changed}
    assert remat_cache.key(other) != remat_cache.key(STEP)
    assert remat_cache.recall(run_b, cache, other) is None and remat_cache.recall(run_a, cache, other) is None


def test_a_record_for_another_step_or_naming_no_candidate_is_not_read(tmp_path: Path) -> None:
    run_a, run_b, cache = _dirs(tmp_path)
    shared = Path(cache) / remat_cache.FOLDER / f"{remat_cache.key(STEP)}.json"
    shared.parent.mkdir(parents=True)
    for record in ({"policy": "dots", "program": None, "for": {**STEP, "rule": "fsdp"}},  # its name, another step
                   {"policy": "dots_all", "program": None, "for": STEP}, "dots", "{not json"):
        shared.write_text(record if isinstance(record, str) else json.dumps(record))
        assert remat_cache.recall(run_b, cache, STEP) is None, record
    shared.write_text(json.dumps({"policy": "full", "for": STEP}))  # no program digest: the fit alone checks it
    assert remat_cache.recall(run_b, cache, STEP) == remat_auto.Remembered("full", None, "an earlier run in another "
                                                                                         "run dir")


def test_a_cpu_choice_stays_in_its_run_dir_and_a_cache_it_cannot_write_is_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_a, _, cache = _dirs(tmp_path)
    remat_cache.remember(run_a, cache, STEP, _choice("none", available=None))  # memory not known: nothing chosen
    assert remat_cache.ran(run_a) == "none" and not Path(cache).exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="job.train"):
        remat_cache.remember(run_a, str(blocker / "jax"), STEP, _choice("dots"))  # a file where the folder would be
    assert remat_cache.ran(run_a) == "dots"
    assert any("could not remember the choice" in r.getMessage() for r in caplog.records)


def test_a_fresh_trace_of_the_same_step_lowers_to_the_program_a_record_names() -> None:
    cfg = model.ModelConfig(vocab_size=64, seq_len=32, dim=32, heads=2, layers=2, mlp_dim=64)  # remat auto
    tokens, mask = jnp.ones((4, 33), jnp.int32), jnp.ones((4, 33), jnp.float32)

    def program(policy: str) -> str:
        graphdef, weights = nnx.split(model.Transformer(cfg, rngs=nnx.Rngs(0)))
        step = jax.jit(jax.grad(lambda w: model.loss_fn(nnx.merge(graphdef, w), tokens, mask)[0]))  # a fresh jit
        with rematerialize.choosing(policy):
            return remat_auto.program_of(step.lower(weights).as_text())

    assert program("dots") == program("dots") != program("full")


def test_the_policy_compiled_first_is_the_remembered_one_where_it_is_a_candidate_else_the_fastest() -> None:
    assert remat_auto.order_of(None) == rematerialize.CANDIDATES == ("none", "dots", "full")
    assert remat_auto.order_of(remat_auto.Remembered("dots")) == ("dots", "none", "full")
    assert remat_auto.order_of(remat_auto.Remembered("dots_all")) == rematerialize.CANDIDATES  # not auto's to take
