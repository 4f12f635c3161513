"""job.train.evaluation on 8 CPU devices: which batches an evaluation reads (a fixed number, or one full pass
over a finite split whose last partial batch is cut into a sharded part and a whole remainder), and
that a full pass over a mesh equals the model on every row at once."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from job import sharding
from job.errors import ConfigError
from job.train.evaluation import (
    Evaluator,
    Piece,
    check_splits,
    pieces,
    size_of,
    summary_fields,
)
from job.train.steps import jit_eval_step


def covered(planned: list[Piece]) -> list[int]:
    return [row for p in planned for row in range(p.offset, p.offset + p.rows)]


@pytest.mark.parametrize(("size", "batch", "divisor"), [(50, 16, 4), (37, 16, 4), (48, 16, 4), (3, 16, 4),
                                                         (1, 8, 8), (100, 8, 1), (17, 16, 2)])
def test_a_full_pass_reads_every_row_once_in_batches_that_split_over_the_data_shards(
        size: int, batch: int, divisor: int) -> None:
    planned = pieces(size, batch=batch, divisor=divisor, batches=2, full=True)
    assert covered(planned) == list(range(size))
    assert all(p.step == 0 for p in planned)
    assert all(p.rows == batch for p in planned[:size // batch])
    assert all(p.whole == (p.rows < divisor and p.rows % divisor != 0) for p in planned)
    assert all(p.rows % divisor == 0 for p in planned if not p.whole)
    assert sum(p.whole for p in planned) == (1 if size % batch % divisor else 0)


def test_the_last_partial_batch_is_a_sharded_part_and_a_whole_remainder() -> None:
    assert pieces(37, batch=16, divisor=4, batches=1, full=True) == [
        Piece(0, 0, 16), Piece(0, 16, 16), Piece(0, 32, 4), Piece(0, 36, 1, whole=True)]


def test_without_a_full_pass_a_finite_split_reads_its_first_batches_and_an_endless_one_numbered_batches() -> None:
    assert pieces(50, batch=16, divisor=4, batches=2, full=False) == [Piece(0, 0, 16), Piece(0, 16, 16)]
    assert covered(pieces(50, batch=16, divisor=4, batches=9, full=False)) == list(range(50))  # shorter: all of it
    assert pieces(None, batch=16, divisor=4, batches=3, full=True) == [Piece(s, 0, 16) for s in range(3)]
    assert pieces(None, batch=16, divisor=4, batches=0, full=True) == []


def test_a_batch_the_data_shards_do_not_split_is_read_as_its_sharded_rows_and_a_whole_rest() -> None:
    # a run trained with batch 32 on 4 devices, evaluated on 3: each batch is still 32 rows, the same rows
    assert pieces(None, batch=32, divisor=3, batches=2, full=False) == [
        Piece(0, 0, 30), Piece(0, 30, 2, whole=True), Piece(1, 0, 30), Piece(1, 30, 2, whole=True)]
    assert covered(pieces(70, batch=32, divisor=3, batches=1, full=True)) == list(range(70))


class Sized:
    def __init__(self, sizes: dict) -> None:
        self.sizes = sizes

    def split_size(self, split: str) -> object:
        return self.sizes[split]


def test_a_split_size_is_a_positive_row_count_or_none() -> None:
    assert size_of(object(), "eval") is None  # no split_size(): endless
    assert size_of(Sized({"eval": 5}), "eval") == 5 and size_of(Sized({"eval": None}), "eval") is None
    assert size_of(Sized({"eval": np.int64(7)}), "eval") == 7  # a numpy count is a count
    for bad in (0, -1, 2.5, "5", True):
        with pytest.raises(ConfigError, match="the size of eval split 'eval': expected a number of rows >= 1") as err:
            size_of(Sized({"eval": bad}), "eval")
        assert f"found {bad!r}" in str(err.value) and "Fix: return the split's row count from Sized.split_size" in str(
            err.value)


class Images:
    """A source as image tutorials write one: `size` is its image side, not the split-size method."""

    def __init__(self) -> None:
        self.size = 32

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        return {"x": np.zeros((stop - start, self.size, self.size), np.float32)}


class Shaped:
    def size(self) -> tuple[int, int]:  # a method of its own, without the split
        return (32, 32)


def test_a_sources_own_size_is_not_the_split_size_and_is_never_called() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing is said about it
        assert size_of(Images(), "eval") is None and size_of(Images(), "test") is None
        assert size_of(Shaped(), "eval") is None
    mesh = sharding.make_mesh()
    evaluator = Evaluator(lambda state, batch: {}, Images(), mesh, splits=("eval",), global_batch=8, batches=2,
                          full=True, weight=None)
    assert evaluator.plan["eval"] == [Piece(0, 0, 8), Piece(1, 0, 8)]  # endless: --data.eval-batches batches


class OldSized:
    def size(self, split: str) -> int | None:  # the protocol's first name
        return 12 if split == "test" else None


class OldSizedWrong:
    def size(self, split: str) -> str:  # a method taking the split, but no row count
        return "12"


def test_the_old_size_method_still_works_and_says_to_rename_it() -> None:
    with pytest.warns(FutureWarning, match=r"OldSized.size\(split\) .* is deprecated: rename it "
                                           r"OldSized.split_size\(split\)"):
        assert size_of(OldSized(), "test") == 12
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="the size of eval split 'test'") as err:
        size_of(OldSizedWrong(), "test")
    assert "define split_size(split) if OldSizedWrong.size means something else" in str(err.value)


def test_a_split_size_that_is_not_a_method_taking_the_split_is_one_error() -> None:
    for wrong in (40, lambda: 40):
        source = Images()
        source.split_size = wrong  # type: ignore[attr-defined]
        with pytest.raises(ConfigError, match=r"Images.split_size: expected a method split_size\(split\)") as err:
            size_of(source, "test")
        assert "Fix: define def split_size(self, split) on Images" in str(err.value)


@pytest.mark.parametrize("splits", [("train",), ("eval", "eval"), ("hosts",), ("two words",), ("",)])
def test_declared_splits_are_distinct_names_that_are_not_the_loops_own(splits: tuple) -> None:
    with pytest.raises(ConfigError, match="Task.eval_splits of mine: expected distinct identifiers"):
        check_splits(splits, "mine")
    check_splits(("eval", "test", "valid_2"), "mine")


def test_the_summary_names_each_split_and_its_ema() -> None:
    got = summary_fields(("eval", "test"), {"eval": {"loss": 1.0, "ema_loss": 2.0}}, ("loss",), ema=True)
    assert got == {"eval_loss": 1.0, "eval_ema_loss": 2.0, "test_loss": None, "test_ema_loss": None}


class Table:
    """A finite split of 37 rows and an endless one; rows are a pure function of (split, step, row)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(37, 6)).astype(np.float32)
        self.y = rng.integers(0, 3, 37).astype(np.int32)
        self.calls: list[tuple] = []

    def split_size(self, split: str) -> int | None:
        return 37 if split == "test" else None

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        self.calls.append((split, step, start, stop))
        index = np.arange(start, stop) if split == "test" else (np.arange(start, stop) + 7 * step) % 37
        return {"x": self.x[index], "y": self.y[index]}


def loss(model: nnx.Module, batch: dict) -> tuple:
    logits = model(batch["x"])
    value = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1))
    return value, {"loss": value, "accuracy": jnp.mean(logits.argmax(-1) == batch["y"])}


def test_a_full_pass_over_a_mesh_equals_the_model_on_every_row_at_once() -> None:
    mesh = sharding.make_mesh(model_axis=2)  # data 4 x model 2
    model = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split({"model": model})
    source = Table()
    step = jit_eval_step(loss, graphdef)
    evaluator = Evaluator(step, source, mesh, splits=("test", "eval"), global_batch=16, batches=2, full=True,
                          weight=None)
    assert evaluator.rows("test") == 37 and evaluator.rows("eval") == 32
    with sharding.mesh_context(mesh):
        results = evaluator.run(state)
    whole = {k: float(v) for k, v in loss(model, {"x": source.x, "y": source.y})[1].items()}
    assert results["test"] == pytest.approx(whole, rel=1e-6)
    rows_read = sorted(r for split, _, start, stop in source.calls if split == "test" for r in range(start, stop))
    assert rows_read == list(range(37))  # one process holds every data shard here: each row read once
    first = {"x": source.x[np.arange(16) % 37], "y": source.y[np.arange(16) % 37]}
    second = {"x": source.x[(np.arange(16) + 7) % 37], "y": source.y[(np.arange(16) + 7) % 37]}
    endless = {k: (float(loss(model, first)[1][k]) + float(loss(model, second)[1][k])) / 2 for k in whole}
    assert results["eval"] == pytest.approx(endless, rel=1e-6)


def test_a_signal_during_evaluation_gives_none() -> None:
    mesh = sharding.make_mesh()
    model = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split({"model": model})
    evaluator = Evaluator(jit_eval_step(loss, graphdef), Table(), mesh, splits=("test",), global_batch=8,
                          batches=1, full=True, weight=None)
    with sharding.mesh_context(mesh):
        assert evaluator.run(state, should_stop=lambda: True) is None


def test_an_evaluation_compiled_ahead_compiles_nothing_when_it_runs(caplog: pytest.LogCaptureFixture) -> None:
    import jax

    mesh = sharding.make_mesh(model_axis=2)
    model = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split({"model": model})
    evaluator = Evaluator(jit_eval_step(loss, graphdef), Table(), mesh, splits=("test", "eval"), global_batch=16,
                          batches=2, full=True, weight=None)
    assert {(p.rows, p.whole) for p in evaluator.plan["test"]} == {(16, False), (4, False), (1, True)}

    def compiled() -> list[str]:  # the programs jax lowered for compilation (logged with jax_log_compiles)
        return [r.getMessage().split(" with ")[0] for r in caplog.records if r.getMessage().startswith("Compiling ")]

    with jax.log_compiles(True), caplog.at_level("WARNING"), sharding.mesh_context(mesh):
        evaluator.compile(state)
        ahead = compiled()
        results = evaluator.run(state)
    assert ahead == ["Compiling jit(eval_step_fn)"] * 3  # the three batch shapes of "test"; "eval" has one of them
    assert compiled() == ahead  # the calls found every shape compiled
    assert set(results) == {"test", "eval"}
