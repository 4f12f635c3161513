"""Tests for job.sharding on 8 fake CPU devices.

These tests need 8 host devices. tests/conftest.py sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported; the
guard below does the same when this file is the first to import jax. By hand:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/unit/test_sharding.py -q
"""

from __future__ import annotations

import os
import sys
import warnings

_FLAG = "--xla_force_host_platform_device_count=8"
if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from job import sharding as sh  # noqa: E402
from job.errors import ConfigError  # noqa: E402

AUTO2 = (AxisType.Auto, AxisType.Auto)


@pytest.fixture(scope="module", autouse=True)
def eight_devices() -> None:
    assert jax.device_count() == 8, (
        f"job.sharding tests need 8 devices, found {jax.device_count()}: set "
        f"XLA_FLAGS={_FLAG} before jax is imported (tests/conftest.py should do this)")


class Net(nnx.Module):
    """Annotated layers, an unannotated variable and three bad annotations."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(4, 8, kernel_metadata=sh.axes("embed", "mlp"),
                             bias_metadata=sh.axes("mlp"), rngs=rngs)
        self.down = nnx.Linear(8, 4, kernel_init=sh.partitioned(nnx.initializers.lecun_normal(),
                                                               ("mlp", "embed")), rngs=rngs)
        self.plain = nnx.Param(jnp.arange(6.0))
        self.bad_rank = nnx.Param(jnp.ones((4, 8)), **sh.axes("embed"))
        self.bad_name = nnx.Param(jnp.ones((4,)), **sh.axes("bogus"))
        self.bad_div = nnx.Param(jnp.ones((6, 8)), **sh.axes("embed", "mlp"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.relu(self.up(x)))


def specs(node: object) -> dict[str, P]:
    return {k: s.spec for k, s in sh.sharding_of(node).items()}


def named(warning: str) -> set[str]:
    """Every variable a fallback warning names: its paths listed under a kind of layer, and each entry whose
    annotation cannot apply (PATH: why)."""
    listed = [line.strip() for line in warning.splitlines() if line.startswith("    ")]
    return {path for line in listed for path in ([line.split(": ")[0]] if ": " in line else line.split(", "))}


def shard_quietly(node: object, mesh: Mesh, rule: str) -> list[str]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        sh.shard_model(node, mesh, rule)
    return [str(w.message) for w in rec if issubclass(w.category, UserWarning)]


# --- constants and annotations -------------------------------------------------------------

def test_constants_are_gensbis_vocabulary_exactly() -> None:
    assert sh.LOGICAL_AXES == ("embed", "mlp", "heads", "vocab", "in", "out")
    assert (sh.MODEL_AXIS, sh.DATA_AXIS, sh.EXPERT_AXIS, sh.SEQUENCE_AXIS) == ("model", "data", "expert", "sequence")
    assert dict(sh.RULES) == {
        "replicated": (("embed", None), ("mlp", None), ("heads", None), ("vocab", None), ("in", None), ("out", None)),
        "fsdp": (("embed", "data"), ("mlp", None), ("heads", None), ("vocab", None), ("in", None), ("out", None)),
        "tensor": (("embed", None), ("mlp", "model"), ("heads", "model"), ("vocab", "model"),
                   ("in", None), ("out", None)),
    }
    assert all(isinstance(v, tuple) for v in sh.RULES.values())
    with pytest.raises(TypeError):
        sh.RULES["mine"] = ()  # type: ignore[index]


def test_the_training_table_extends_gensbis_under_its_own_names() -> None:
    assert sh.TRAIN_LOGICAL_AXES == (*sh.LOGICAL_AXES, "experts", "batch", "length")
    every = (("experts", "expert"), ("batch", ("data", "expert")), ("length", "sequence"))
    assert dict(sh.TRAIN_RULES) == {
        **{rule: (*pairs, *every) for rule, pairs in sh.RULES.items()},
        "fsdp_tensor": (("embed", "data"), ("mlp", "model"), ("heads", "model"), ("vocab", "model"),
                        ("in", None), ("out", None), *every),
    }
    with pytest.raises(TypeError):
        sh.TRAIN_RULES["mine"] = ()  # type: ignore[index]
    assert sh.rule_table("fsdp_tensor")["experts"] == "expert" and sh.rule_table("replicated")["layers"] is None


def test_axes_and_partitioned_values() -> None:
    assert sh.axes("embed", "mlp") == {"out_sharding": ("embed", "mlp"), "eager_sharding": False}
    assert sh.axes() == {"out_sharding": (), "eager_sharding": False}
    p = nnx.Param(sh.partitioned(nnx.initializers.ones, ("embed", "mlp"))(jax.random.key(0), (4, 8)))
    meta = p.get_metadata()
    assert meta["out_sharding"] == ("embed", "mlp") and meta["eager_sharding"] is False
    assert p.shape == (4, 8) and float(p[...].sum()) == 32.0


def test_constructing_model_needs_no_mesh() -> None:
    assert jax.sharding.get_abstract_mesh().empty
    net = Net(nnx.Rngs(0))
    assert net.up.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")
    assert net.down.kernel.get_metadata()["out_sharding"] == ("mlp", "embed")
    assert len(net.up.kernel[...].sharding.device_set) == 1  # inert: not placed yet


# --- meshes --------------------------------------------------------------------------------

def test_make_mesh_forms() -> None:
    m = sh.make_mesh()
    assert m.axis_names == ("data", "model") and dict(m.shape) == {"data": 8, "model": 1}
    assert tuple(m.axis_types) == AUTO2
    m = sh.make_mesh(model_axis=2)
    assert dict(m.shape) == {"data": 4, "model": 2}
    devs = jax.devices()[:4]
    m = sh.make_mesh(devs, model_axis=2)
    assert dict(m.shape) == {"data": 2, "model": 2} and set(m.devices.flat) == set(devs)


@pytest.mark.parametrize("bad", [0, -2, 3, 16, True, 2.0])
def test_make_mesh_rejects_non_divisors(bad: object) -> None:
    with pytest.raises(ValueError, match="positive divisor of the device count 8") as e:
        sh.make_mesh(model_axis=bad)  # type: ignore[arg-type]
    assert isinstance(e.value, ConfigError) and "[1, 2, 4, 8]" in str(e.value)


def test_batch_axes_and_divisor(mesh42: Mesh) -> None:
    assert sh.batch_axes(mesh42) == ("data",) and sh.batch_size_divisor(mesh42) == 4
    m3 = jax.make_mesh((2, 2, 2), ("replica", "data", "model"), axis_types=(AxisType.Auto,) * 3)
    assert sh.batch_axes(m3) == ("replica", "data") and sh.batch_size_divisor(m3) == 4
    assert sh.batch_size_divisor(sh.make_mesh(model_axis=8)) == 1


def test_the_loops_batch_axes_leave_sequence_to_the_model_and_gensbis_keep_every_axis_but_model() -> None:
    mesh = sh.make_mesh(axes={"data": 2, "sequence": 2, "model": 2})
    assert sh.batch_axes(mesh) == ("data", "sequence") and sh.batch_size_divisor(mesh) == 4  # DESIGN.md §3
    assert sh.data_parallel_axes(mesh) == ("data",) and sh.data_parallel_size(mesh) == 2
    assert sh.batch_sharding(mesh).spec == P(("data",))
    assert sh.shard_batch(np.ones((4, 3), np.float32), mesh).sharding.spec == P(("data", "sequence"))
    for named in ({"data": 4, "model": 2}, {"data": 2, "expert": 2, "model": 2}):  # the same without "sequence"
        other = sh.make_mesh(axes=named)
        assert sh.data_parallel_axes(other) == sh.batch_axes(other)


def test_the_old_names_of_the_loops_batch_axes_warn_and_answer_as_the_new_ones() -> None:
    mesh = sh.make_mesh(axes={"data": 2, "sequence": 2, "model": 2})
    with pytest.warns(DeprecationWarning, match="train_batch_axes is now job.sharding.data_parallel_axes"):
        assert sh.train_batch_axes(mesh) == sh.data_parallel_axes(mesh) == ("data",)
    with pytest.warns(DeprecationWarning, match="train_batch_size_divisor is now job.sharding.data_parallel_size"):
        assert sh.train_batch_size_divisor(mesh) == sh.data_parallel_size(mesh) == 2


def test_a_batch_placed_by_batch_sharding_is_split_over_the_batch_axes_and_whole_over_model(mesh42: Mesh) -> None:
    rows = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    placed = jax.device_put(rows, sh.batch_sharding(mesh42))
    assert {s.data.shape for s in placed.addressable_shards} == {(2, 3)}  # 8 rows over data=4, whole over model=2
    held = {s.device: np.asarray(s.data) for s in placed.addressable_shards}
    for group in mesh42.devices:  # a row of the mesh: one data shard, every model device holds the same rows
        assert all(np.array_equal(held[d], held[group[0]]) for d in group)
    stacked = jax.device_put(np.stack([rows, rows + 100]), sh.batch_sharding(mesh42, whole=1))
    assert {s.data.shape for s in stacked.addressable_shards} == {(2, 2, 3)}  # the stack's axis kept whole
    m3 = jax.make_mesh((2, 2, 2), ("replica", "data", "model"), axis_types=(AxisType.Auto,) * 3)
    assert {s.data.shape for s in jax.device_put(rows, sh.batch_sharding(m3)).addressable_shards} == {(2, 3)}


def test_resolve_mesh(mesh42: Mesh) -> None:
    assert sh.resolve_mesh(None) is None
    assert sh.resolve_mesh(mesh42) is mesh42
    assert dict(sh.resolve_mesh("auto").shape) == {"data": 8, "model": 1}
    assert dict(sh.resolve_mesh({"model_axis": 2}).shape) == {"data": 4, "model": 2}
    for bad in ("bogus", 3, ["auto"]):
        with pytest.raises(ConfigError, match="expected None, a jax.sharding.Mesh, 'auto'") as e:
            sh.resolve_mesh(bad)  # type: ignore[arg-type]
        assert repr(bad) in str(e.value) and "Fix:" in str(e.value)
    with pytest.raises(ConfigError, match="model_axes"):
        sh.resolve_mesh({"model_axes": 2})


def test_pad_for_mesh(mesh42: Mesh) -> None:
    assert sh.pad_for_mesh(10, mesh42) == (12, 10)
    assert sh.pad_for_mesh(8, mesh42) == (8, 8)
    assert sh.pad_for_mesh(1, mesh42) == (4, 1)
    assert sh.pad_for_mesh(0, mesh42) == (0, 0)
    with pytest.raises(ConfigError, match="non-negative int"):
        sh.pad_for_mesh(-1, mesh42)


def test_mesh_context_sets_and_restores(mesh42: Mesh) -> None:
    assert jax.sharding.get_abstract_mesh().empty
    with sh.mesh_context(mesh42) as m:
        assert m is mesh42
        assert jax.sharding.get_abstract_mesh() == mesh42.abstract_mesh
    assert jax.sharding.get_abstract_mesh().empty
    with pytest.raises(RuntimeError), sh.mesh_context(mesh42):
        raise RuntimeError("boom")
    assert jax.sharding.get_abstract_mesh().empty
    with sh.mesh_context(None) as m:
        assert m is None and jax.sharding.get_abstract_mesh().empty


# --- shard_model ---------------------------------------------------------------------------

EXPECTED = {
    "replicated": {"up/kernel": P(), "up/bias": P(), "down/kernel": P(), "down/bias": P(),
                   "bad_div": P()},
    "fsdp": {"up/kernel": P("data"), "up/bias": P(), "down/kernel": P(None, "data"),
             "down/bias": P(), "bad_div": P()},
    "tensor": {"up/kernel": P(None, "model"), "up/bias": P("model"), "down/kernel": P("model"),
               "down/bias": P(), "bad_div": P(None, "model")},
}
UNANNOTATED_PARAMS = {"plain", "down/bias"}  # listed under every rule but "replicated"
BAD = {"replicated": {"bad_rank", "bad_name"},
       "fsdp": {"bad_rank", "bad_name", "bad_div"} | UNANNOTATED_PARAMS,
       "tensor": {"bad_rank", "bad_name"} | UNANNOTATED_PARAMS}


@pytest.mark.parametrize("rule", ["replicated", "fsdp", "tensor"])
def test_shard_model_specs_and_single_warning(rule: str, mesh42: Mesh) -> None:
    net = Net(nnx.Rngs(0))
    before = {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(net)).items()
              if not isinstance(v, dict)}
    msgs = shard_quietly(net, mesh42, rule)
    got = specs(net)
    assert {k: got[k] for k in EXPECTED[rule]} == EXPECTED[rule]
    for k in ("plain", "bad_rank", "bad_name"):
        assert got[k] == P()
    for s in sh.sharding_of(net).values():
        assert s.mesh == mesh42 and len(s.device_set) == 8
    fell = [m for m in msgs if "fell back" in m]
    assert len(fell) == 1
    assert named(fell[0]) == BAD[rule]
    assert "1 names ('embed',) for an array of rank 2" in fell[0]
    assert "unknown logical axis 'bogus'" in fell[0]
    assert ("not divisible by mesh size 4" in fell[0]) == (rule == "fsdp")
    assert ("parameter(s) of the model's own without an annotation" in fell[0]) == (rule != "replicated")
    assert f"{len(BAD[rule])} variable(s) fell back to replicated" in fell[0]
    assert len([m for m in msgs if "experimental" in m]) == (rule != "replicated")
    assert len(msgs) == 1 + (rule != "replicated")
    for k, v in before.items():
        np.testing.assert_array_equal(np.asarray(getattr(net, k)[...]), v)


def test_shard_model_warns_with_pytest_warns(mesh42: Mesh) -> None:
    net = Net(nnx.Rngs(0))
    with pytest.warns(UserWarning, match=r"2 variable\(s\) fell back to replicated") as rec:
        assert sh.shard_model(net, mesh42) is net
    assert len(rec) == 1


class Mixed(nnx.Module):
    """One unannotated nnx.Param beside unannotated variables of other kinds."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.kernel = nnx.Param(jnp.ones((4, 8)), **sh.axes("embed", "mlp"))
        self.scale = nnx.Param(jnp.ones((8,)))
        self.temperature = nnx.Param(jnp.float32(1.0), **sh.axes())  # a scalar, annotated: nothing to split
        self.whole = nnx.Param(jnp.ones((8,)), **sh.axes(None))  # replicated on purpose
        self.mean = nnx.BatchStat(jnp.zeros((8,)))
        self.counter = nnx.Variable(jnp.zeros((3,)))
        self.rngs = rngs


@pytest.mark.parametrize("rule", ["fsdp", "tensor"])
def test_unannotated_params_are_named_in_the_one_fallback_warning(rule: str, mesh42: Mesh) -> None:
    mixed = Mixed(nnx.Rngs(0))
    msgs = shard_quietly(mixed, mesh42, rule)
    assert len(msgs) == 2 and "experimental" in msgs[0]
    lines = msgs[1].splitlines()
    assert lines[0] == (f"shard_model(rule={rule!r}): 1 variable(s) fell back to replicated on the mesh "
                        "{'data': 4, 'model': 2}:")
    assert lines[1].startswith("- 1 norm scale(s) without an annotation") and lines[2] == "    scale"
    assert lines[-1].startswith("Fix: annotate where the layer is built, as shown, with job.sharding.axes(...)")
    got = specs(mixed)
    assert got["scale"] == P() and got["whole"] == P() and got["temperature"] == P()
    assert got["kernel"] == (P("data") if rule == "fsdp" else P(None, "model"))


class Unannotated(nnx.Module):
    """Layers built without annotations, as a model from a tutorial builds them."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln = nnx.LayerNorm(8, rngs=rngs)
        self.norm = nnx.RMSNorm(8, rngs=rngs)
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.conv = nnx.Conv(3, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)


def test_the_fallback_warning_groups_unannotated_layers_by_kind_with_the_argument_that_annotates_each(
        mesh42: Mesh) -> None:
    msgs = shard_quietly(Unannotated(nnx.Rngs(0)), mesh42, "fsdp")
    [fell] = [m for m in msgs if "fell back" in m]
    lines = fell.splitlines()
    assert lines[1:-1] == [
        '- 2 norm scale(s) without an annotation (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm): '
        'scale_metadata=job.sharding.axes("embed")',
        "    ln/scale, norm/scale",
        '- 1 norm bias(es) without an annotation (nnx.LayerNorm, nnx.BatchNorm): '
        'bias_metadata=job.sharding.axes("embed")',
        "    ln/bias",
        '- 1 embedding table(s) without an annotation (nnx.Embed): '
        'embedding_metadata=job.sharding.axes("vocab", "embed")',
        "    embed/embedding",
        '- 2 kernel(s) without an annotation (nnx.Linear; an nnx.Conv\'s is axes(None, None, "embed", "mlp")): '
        'kernel_metadata=job.sharding.axes("embed", "mlp")',
        "    conv/kernel, up/kernel",
        '- 1 bias(es) without an annotation (nnx.Linear, nnx.Conv): bias_metadata=job.sharding.axes("mlp") (the name '
        'of its kernel\'s last dimension)',
        "    up/bias"]
    assert lines[0].startswith("shard_model(rule='fsdp'): 7 variable(s) fell back to replicated on the mesh")
    assert lines[-1].startswith("Fix: annotate where the layer is built")
    # the arguments shown are the layers' own: annotated so, nothing falls back
    annotated = nnx.LayerNorm(8, scale_metadata=sh.axes("embed"), bias_metadata=sh.axes("embed"), rngs=nnx.Rngs(0))
    assert not [m for m in shard_quietly(annotated, mesh42, "fsdp") if "fell back" in m]
    assert specs(annotated)["scale"] == P("data")


class AsTheTableSays(nnx.Module):
    """Every layer of docs/sharding.md's table annotated with the arguments it shows."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        ax = sh.axes
        self.linear = nnx.Linear(8, 16, kernel_metadata=ax("embed", "mlp"), bias_metadata=ax("mlp"), rngs=rngs)
        self.conv = nnx.Conv(8, 16, kernel_size=(3, 3), kernel_metadata=ax(None, None, "embed", "mlp"),
                             bias_metadata=ax("mlp"), rngs=rngs)
        self.embed = nnx.Embed(16, 8, embedding_metadata=ax("vocab", "embed"), rngs=rngs)
        self.ln = nnx.LayerNorm(8, scale_metadata=ax("embed"), bias_metadata=ax("embed"), rngs=rngs)
        self.bn = nnx.BatchNorm(8, scale_metadata=ax("embed"), bias_metadata=ax("embed"), rngs=rngs)
        self.rms = nnx.RMSNorm(8, scale_metadata=ax("embed"), rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 8, decode=False, kernel_metadata=ax("embed", "heads", None),
                                           bias_metadata=ax("heads", None),
                                           out_kernel_metadata=ax("heads", None, "embed"),
                                           out_bias_metadata=ax("embed"), rngs=rngs)


def test_every_layer_annotated_as_the_docs_table_shows_splits_under_every_rule(mesh42: Mesh) -> None:
    with nnx.use_eager_sharding(False):
        _, abstract_state = nnx.split(nnx.eval_shape(lambda: AsTheTableSays(nnx.Rngs(0))))
    for rule in sh.TRAIN_RULES:
        shardings, fallbacks = sh.placement(abstract_state, mesh42, rule)
        assert fallbacks == [], (rule, fallbacks)
    got = {"/".join(map(str, p)): s.spec for p, s in nnx.to_flat_state(shardings)}  # fsdp_tensor's
    assert got["conv/kernel"] == P(None, None, "data", "model") and got["ln/scale"] == P("data")
    assert got["attn/query/kernel"] == P("data", "model") and got["attn/out/kernel"] == P("model", None, "data")


def test_shard_models_warnings_are_the_message_alone_without_a_python_source_line(mesh42: Mesh) -> None:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        sh.shard_model(nnx.LayerNorm(8, rngs=nnx.Rngs(0)), mesh42, "fsdp")
    assert [w.category for w in rec] == [UserWarning, UserWarning]
    for w in rec:  # as Python prints them: a header and the message, no line of code under it
        shown = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
        assert shown == f"job.sharding:0: UserWarning: {w.message}\n"
    assert 'scale_metadata=job.sharding.axes("embed")' in str(rec[1].message)


def test_the_replicated_rule_says_nothing_about_unannotated_params(mesh42: Mesh) -> None:
    mixed = Mixed(nnx.Rngs(0))
    assert shard_quietly(mixed, mesh42, "replicated") == []
    assert all(s.spec == P() for s in sh.sharding_of(mixed).values())


def test_an_empty_annotation_on_a_matrix_is_a_bad_annotation_not_a_missing_one(mesh42: Mesh) -> None:
    node = nnx.Dict(w=nnx.Param(jnp.ones((4, 8)), **sh.axes()))
    fell = [m for m in shard_quietly(node, mesh42, "replicated") if "fell back" in m]
    assert len(fell) == 1 and "w: 0 names () for an array of rank 2 (4, 8)" in fell[0]


def test_shard_model_idempotent(mesh42: Mesh) -> None:
    net = Net(nnx.Rngs(0))
    shard_quietly(net, mesh42, "tensor")
    first = sh.sharding_of(net)
    vals = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(net)))
    shard_quietly(net, mesh42, "tensor")
    assert sh.sharding_of(net) == first
    jax.tree.map(np.testing.assert_array_equal, vals,
                 jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(net))))


def test_a_mesh_without_a_known_axis_keeps_its_dimensions_whole_and_an_axis_it_lacks_else_falls_back() -> None:
    data_only = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    net = Net(nnx.Rngs(0))
    said = "".join(m for m in shard_quietly(net, data_only, "tensor") if "fell back" in m)
    assert "bad_name:" in said and "up/kernel" not in said  # no "model" axis: as if of size 1
    assert specs(net)["up/kernel"] == P()
    state = nnx.state(Net(nnx.Rngs(0)))
    _, fallbacks = sh.placement(state, data_only, "tensor", {"mlp": {"tensor": "stage"}})  # a name of its own
    assert any("up/kernel: 'mlp' maps to mesh axis 'stage', absent from mesh axes ('data',)" in f for f in fallbacks)


class Experts(nnx.Module):
    """A mixture of experts' kernels, annotated as MaxText annotates them."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.wi = nnx.Param(sh.partitioned(nnx.initializers.lecun_normal(), ("experts", "embed", "mlp"))(
            rngs.params(), (4, 8, 16)))


def test_two_dimensions_on_one_mesh_axis_the_first_takes_it_the_later_stays_whole_with_one_note() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    state = nnx.state(Experts(nnx.Rngs(0)))
    notes: list[str] = []
    shardings, fallbacks = sh.placement(state, mesh, "tensor", {"experts": {"tensor": "model"}}, notes=notes)
    assert not fallbacks and shardings["wi"].spec == P("model")  # experts over "model", mlp whole
    assert notes == ["('experts', 'embed', 'mlp'): 'mlp' stays whole, mesh axis 'model' already splits its "
                     "'experts' dimension"]
    # with an expert axis of its own: experts over it, embed over data under fsdp, mlp over model under tensor
    mesh3 = jax.make_mesh((2, 2, 2), ("data", "expert", "model"), axis_types=(AxisType.Auto,) * 3)
    assert sh.placement(state, mesh3, "fsdp_tensor")[0]["wi"].spec == P("expert", "data", "model")
    assert sh.placement(state, mesh3, "tensor")[0]["wi"].spec == P("expert", None, "model")


def test_a_mesh_of_named_axes_fills_in_its_minus_one_and_its_batch_axes_are_all_but_model() -> None:
    mesh = sh.make_mesh(axes={"data": -1, "expert": 2, "model": 2})
    assert dict(mesh.shape) == {"data": 2, "expert": 2, "model": 2} and sh.batch_axes(mesh) == ("data", "expert")
    assert sh.data_parallel_size(sh.make_mesh(axes={"data": 2, "sequence": 4})) == 2  # sequence: not the batch


def test_constrain_lays_an_activation_out_by_logical_names_under_the_rules_and_is_a_no_op_outside() -> None:
    mesh = sh.make_mesh(axes={"data": 2, "sequence": 4})
    x = jnp.ones((4, 8, 6))
    seen = {}

    def layer(x: jax.Array) -> jax.Array:
        y = sh.constrain(x * 2, ("batch", "length", "embed"))
        seen["spec"] = getattr(jax.typeof(y), "sharding", None)
        return y

    assert sh.constrain(x, ("batch", "length", "embed")) is x  # no rules: as it is
    with sh.mesh_context(mesh, rules=sh.rule_table("fsdp")):
        out = jax.jit(layer)(x)
    # batch over data; embed (data under fsdp) stays whole: data is taken by the batch
    assert out.sharding.spec == P("data", "sequence")
    with sh.mesh_context(mesh, rules=sh.rule_table("fsdp")):
        assert jax.jit(lambda x: sh.constrain(x, ("batch", "length", None)))(jnp.ones((3, 8, 6))).shape == (3, 8, 6)


def test_unknown_rule() -> None:
    with pytest.raises(ValueError) as e:
        sh.shard_model(Net(nnx.Rngs(0)), sh.make_mesh(), "zero3")
    msg = str(e.value)
    assert isinstance(e.value, ConfigError)
    assert "'zero3'" in msg and "['fsdp', 'replicated', 'tensor']" in msg and "Fix:" in msg


def test_explicit_mesh_warns() -> None:
    explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    model = nnx.Linear(4, 8, kernel_metadata=sh.axes("embed", "mlp"), rngs=nnx.Rngs(0))
    with pytest.warns(UserWarning, match="Explicit axes"):
        sh.shard_model(model, explicit)
    assert model.kernel[...].sharding.mesh == explicit


def test_optimizer_state_follows_params(mesh42: Mesh) -> None:
    net = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(net, optax.adam(1e-2), wrt=nnx.Param)
    shard_quietly(net, mesh42, "tensor")
    msgs = shard_quietly(opt, mesh42, "tensor")
    fell = [m for m in msgs if "fell back" in m]
    assert len(fell) == 1
    assert "bad_rank" in fell[0] and "plain" not in fell[0]  # moments are not nnx.Params
    params, state = specs(net), specs(opt)
    for moment in ("mu", "nu"):
        for k in ("up/kernel", "up/bias", "down/kernel", "bad_div", "plain"):
            assert state[f"opt_state/0/{moment}/{k}"] == params[k]
    assert state["opt_state/0/mu/up/kernel"] == P(None, "model")
    assert state["opt_state/0/count"] == P() and state["step"] == P()

    @nnx.jit
    def step(net: Net, opt: nnx.Optimizer, x: jax.Array) -> None:
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(net)
        opt.update(net, grads)

    step(net, opt, sh.shard_batch(jnp.ones((8, 4)), mesh42))
    assert int(opt.step[...]) == 1
    assert specs(net)["up/kernel"] == P(None, "model")  # still sharded after an update


def test_shard_model_handles_rng_keys(mesh42: Mesh) -> None:
    rngs = nnx.Rngs(0)
    sh.shard_model(rngs, mesh42)
    got = sh.sharding_of(rngs)
    assert set(got) == {"default/count", "default/key"}
    assert all(s.spec == P() and len(s.device_set) == 8 for s in got.values())


# --- batches -------------------------------------------------------------------------------

def test_shard_batch(mesh42: Mesh) -> None:
    x = np.arange(48.0).reshape(16, 3)
    batch = {"x": x, "y": jnp.arange(16), "n": 5, "s": "abc", "none": None, "t": jnp.float32(2.0)}
    out = sh.shard_batch(batch, mesh42)
    assert out["x"].sharding == NamedSharding(mesh42, P("data"))
    assert out["y"].sharding.spec == P("data") and out["t"].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    assert out["n"] == 5 and out["s"] == "abc" and out["none"] is None
    assert len(out["x"].addressable_shards) == 8 and out["x"].addressable_shards[0].data.shape == (4, 3)
    same = sh.shard_sample_init(batch, mesh42)
    assert same["x"].sharding == out["x"].sharding
    with pytest.raises(ConfigError, match="multiple of 4"):
        sh.shard_batch({"x": np.ones((6, 2))}, mesh42)


def test_replicate(mesh42: Mesh) -> None:
    out = sh.replicate({"a": np.ones((3, 5)), "b": 7, "c": "s"}, mesh42)
    assert out["a"].sharding == NamedSharding(mesh42, P()) and len(out["a"].sharding.device_set) == 8
    assert out["b"] == 7 and out["c"] == "s"


def test_check_batch_divisible() -> None:
    mesh = sh.make_mesh()
    assert sh.check_batch_divisible({"x": np.ones((16, 2)), "y": np.ones(16), "k": 3}, mesh, "train batch") == 16
    with pytest.raises(ConfigError) as e:
        sh.check_batch_divisible({"x": np.ones((12, 2))}, mesh, "train batch")
    msg = str(e.value)
    assert msg.startswith("train batch:") and "found 12" in msg and "multiple of 8" in msg
    assert "use a batch size that is a multiple of 8, e.g. 16" in msg
    with pytest.raises(ConfigError, match=r"found \[8, 12\]") as e:
        sh.check_batch_divisible({"x": np.ones((8, 2)), "y": np.ones(12)}, mesh, "eval batch")
    assert str(e.value).startswith("eval batch:")
