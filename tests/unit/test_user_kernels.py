"""A user's model through the library's kernels (tests/user_tasks/llama_fast.py: grouped-query attention with 12
query and 4 kv heads, remat by name, the chunked head loss), and what the library offers a model it does not
own: the documented change is a few lines, splash (Pallas' interpret mode) gives XLA's float32 loss and gradients
under every rule, and an out-of-memory offers only flags the model's own parser takes."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import job.errors
from job import kernels
from job import sharding as sh
from job.kernels import self_attention
from job.tasks.lm.task import TASK as LM
from job.runtime.device_memory import Need
from job.train import config, memory
from tests.user_tasks import llama, llama_fast

ROOT = Path(__file__).resolve().parents[2]
# 12 query heads over 4 kv heads, as the chip's model; a length splash's smallest tile divides
SMALL = dict(vocab=64, seq_len=128, dim=96, layers=2, heads=12, kv_heads=4, mlp=128)


def _code(path: Path) -> list[str]:
    """The file's lines after its module docstring, stripped."""
    text = path.read_text()
    return [line.strip() for line in text[text.index('"""', 3) + 3:].splitlines()]


def test_the_documented_change_to_a_users_model_is_at_most_fifteen_lines() -> None:
    before, after = _code(ROOT / "tests/user_tasks/llama.py"), _code(ROOT / "tests/user_tasks/llama_fast.py")
    changed = [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---") and line[1:].strip()
               and "llama_fast" not in line and 'name="llama"' not in line]  # a second file's name: not a change
    added = [line for line in changed if line.startswith("+")]
    assert len(added) <= 15, "\n".join(changed)
    assert any("kernels.attention(q, k, v)" in line for line in added)
    assert any("kernels.remat(block_call" in line for line in added)
    assert any("kernels.head_cross_entropy(" in line for line in added)
    docs = (ROOT / "docs/your-model.md").read_text()
    assert all(line[1:].strip() in docs for line in added if "kernels." in line), "docs/your-model.md shows them"


def _loss_and_grads(kernel: str, rule: str, monkeypatch: pytest.MonkeyPatch) -> tuple[jax.Array, nnx.State]:
    """One float32 step's loss and gradients of the user's model, attention by `kernel`, on a (data, model) mesh
    of 4 devices under `rule`, its parameters placed by their annotations."""
    monkeypatch.setattr(kernels, "attention", functools.partial(self_attention.attention, kernel=kernel))
    cfg = llama_fast.ModelConfig(**SMALL, remat="dots")
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    with nnx.use_eager_sharding(False):
        model = llama_fast.Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    placed, _ = sh.placement(state, mesh, rule)
    state = jax.device_put(state, placed)
    tokens = llama_fast.Rows(cfg.vocab, cfg.seq_len).rows("train", 0, 0, 4)["tokens"]
    batch = {"tokens": jax.device_put(jnp.asarray(tokens), sh.batch_sharding(mesh))}

    def loss(state: nnx.State) -> jax.Array:
        return llama_fast.loss(nnx.merge(graphdef, state), batch)[0]

    with sh.mesh_context(mesh, sh.rule_table(rule)):
        return jax.jit(jax.value_and_grad(loss))(state)


@pytest.mark.parametrize("rule", ["replicated", "fsdp", "tensor", "fsdp_tensor"])
def test_a_users_grouped_query_model_gets_xlas_loss_and_gradients_from_splash_under_every_rule(
        rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    loss_x, grads_x = _loss_and_grads("xla", rule, monkeypatch)
    loss_s, grads_s = _loss_and_grads("splash", rule, monkeypatch)
    assert abs(float(loss_s) - float(loss_x)) <= 1e-6
    worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), grads_x, grads_s)))
    assert 0 <= worst <= 1e-6, worst


def _cfg(task: object, *flags: str) -> config.TrainConfig:
    return config.parse(list(flags), task)  # type: ignore[arg-type]


def test_an_out_of_memory_offers_a_boolean_remat_only_the_flag_its_parser_takes() -> None:
    cfg = _cfg(llama.TASK, "--task", "tests.user_tasks.llama:TASK", "--model.no-remat")
    need = Need(False, 30 * 2**30, 16 * 2**30)
    offered = [r.flags for r in memory.suggested(cfg, llama.TASK, 1, 1, need)]
    assert ("--model.remat",) in offered
    assert not [f for f in offered if f[:1] == ("--model.remat",) and len(f) > 1], offered  # no 'full', no 'dots'
    for flags in offered:  # each parses for this model, as typed after the run's own flags
        assert config.parse_onto(cfg, llama.TASK, flags) is not None, flags
    remembered = next(r for r in memory.suggested(cfg, llama.TASK, 1, 1, need) if r.flags == ("--model.remat",))
    assert remembered.cfg.model.remat is True


def test_a_policy_name_is_offered_where_remat_is_a_string_and_nothing_where_it_is_set_already() -> None:
    cfg = _cfg(LM, "--model.remat", "none")
    assert [r.flags for r in memory.remat_remedies(cfg, LM)] == [("--model.remat", "dots"), ("--model.remat", "full")]
    on = _cfg(llama.TASK, "--task", "tests.user_tasks.llama:TASK")  # remat=True already: nothing to offer
    assert list(memory.remat_remedies(on, llama.TASK)) == []
    assert config.parse_onto(on, llama.TASK, ["--model.remat", "full"]) is None


def test_remat_by_name_keeps_a_blocks_input_split_by_rows_under_fsdp() -> None:
    """Under fsdp a model that annotates only its parameters has its block inputs laid out by rows."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    seen: list[object] = []

    def call(block: object, x: jax.Array) -> jax.Array:
        seen.append(jax.typeof(x).sharding.spec if hasattr(jax, "typeof") else None)
        return x * 2

    wrapped = kernels.remat(call, "full")
    x = jnp.ones((8, 16, 32))
    with sh.mesh_context(mesh, sh.rule_table("fsdp")):
        text = jax.jit(lambda x: wrapped(None, x)).lower(x).as_text()
    np.testing.assert_allclose(wrapped(None, x), x * 2)
    assert "sharding_constraint" in text or "Sharding" in text, "the block's input is constrained"
    assert dataclasses.is_dataclass(llama_fast.ModelConfig)


def test_a_users_model_names_its_own_flag_in_the_kernels_error() -> None:
    """The kernels know no command line: llama_fast passes its flag, so a policy that is not one names it."""
    with nnx.use_eager_sharding(False):
        model = llama_fast.Llama(llama_fast.ModelConfig(**SMALL, remat="dot"), rngs=nnx.Rngs(0))
    tokens = llama_fast.Rows(SMALL["vocab"], SMALL["seq_len"]).rows("train", 0, 0, 2)["tokens"]
    with pytest.raises(job.errors.ConfigError) as e:
        llama_fast.loss(model, {"tokens": jnp.asarray(tokens)})
    assert str(e.value).startswith("--model.remat: expected one of none, full, dots, dots_all, auto")
    assert "pass --model.remat auto" in str(e.value)
