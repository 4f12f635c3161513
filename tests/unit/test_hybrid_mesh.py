"""Meshes over devices of several slices (GPU nodes, TPU slices) are hybrid meshes.

jax gives each GPU node (and each TPU slice) its own `slice_index`. Stand-in
device objects reproduce such topologies in one CPU process; jax's mesh_utils
and `jax.sharding.Mesh` accept them.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from job import multihost
from job import sharding as sh
from job.errors import ConfigError
from job.parallel.mesh import hybrid_mesh

H100 = "NVIDIA H100 80GB HBM3"
MODEL_AXES = range(1, 9)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """A GPU as jax describes it: each node is its own slice."""

    id: int
    process_index: int
    slice_index: int
    platform: str = "gpu"
    device_kind: str = H100


@dataclasses.dataclass(frozen=True)
class PlainDevice:
    """A device without slice_index, like jax 0.10.2's CPU devices."""

    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = H100


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """A TPU v4 chip: the mesh layout inside a slice follows `coords`."""

    id: int
    process_index: int
    slice_index: int
    coords: tuple[int, int, int]
    core_on_chip: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v4"


@dataclasses.dataclass(frozen=True)
class Topology:
    slices: int
    per_slice: int
    per_process: int

    @property
    def devices(self) -> int:
        return self.slices * self.per_slice

    @property
    def processes(self) -> int:
        return self.devices // self.per_process

    def gpus(self) -> list[Gpu]:
        """Device ids and processes numbered node by node, as jax numbers them."""
        return [Gpu(i, i // self.per_process, i // self.per_slice) for i in range(self.devices)]

    def __str__(self) -> str:
        return f"{self.slices}x{self.per_slice}gpu-{self.per_process}per-process"


TOPOLOGIES = [Topology(s, g, p) for s in (2, 3, 4) for g in (4, 8) for p in (g, 2, 1)]
VALID = [(t, m) for t in TOPOLOGIES for m in MODEL_AXES if t.per_slice % m == 0]
INVALID = [(t, m) for t in TOPOLOGIES for m in MODEL_AXES if t.per_slice % m]


def _ids(case: tuple[Topology, int]) -> str:
    return f"{case[0]}-model{case[1]}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _process_rows(mesh: Mesh) -> dict[int, list[int]]:
    """{process: the data-parallel rows (first mesh axis) its devices hold}."""
    rows: dict[int, set[int]] = {}
    for r, row in enumerate(mesh.devices.reshape(mesh.devices.shape[0], -1)):
        for d in row:
            rows.setdefault(d.process_index, set()).add(r)
    return {p: sorted(rs) for p, rs in sorted(rows.items())}


def _assert_loader_order(mesh: Mesh) -> None:
    """Each process's rows are one block, and the blocks follow process order (job.train.batches)."""
    blocks = _process_rows(mesh)
    for p, rows in blocks.items():
        assert rows == list(range(rows[0], rows[-1] + 1)), f"process {p} holds rows {rows}"
    starts = [rows[0] for rows in blocks.values()]
    assert starts == sorted(starts)


# ------------------------------------------------------------------------ the problem


def test_raw_jax_make_mesh_rejects_devices_of_several_slices() -> None:
    devices = Topology(4, 4, 4).gpus()
    with pytest.raises(ValueError, match="does not support multi-slice topologies"):
        jax.make_mesh((16, 1), ("data", "model"), devices=devices)


# ------------------------------------------------------------------------ make_mesh


@pytest.mark.parametrize("case", VALID, ids=_ids)
def test_make_mesh_across_slices_has_the_one_slice_shape_and_axes(case: tuple[Topology, int]) -> None:
    topo, m = case
    mesh = sh.make_mesh(topo.gpus(), model_axis=m)
    assert mesh.axis_names == ("data", "model")
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert dict(mesh.shape) == {"data": topo.devices // m, "model": m}
    assert mesh.devices.shape == (topo.devices // m, m)


@pytest.mark.parametrize("case", VALID, ids=_ids)
def test_every_device_appears_exactly_once(case: tuple[Topology, int]) -> None:
    topo, m = case
    devices = topo.gpus()
    flat = list(sh.make_mesh(devices, model_axis=m).devices.flat)
    assert len(flat) == len(devices)
    assert set(flat) == set(devices)


@pytest.mark.parametrize("case", VALID, ids=_ids)
def test_no_model_group_spans_two_slices(case: tuple[Topology, int]) -> None:
    topo, m = case
    mesh = sh.make_mesh(topo.gpus(), model_axis=m)
    for row in mesh.devices:
        assert len({d.slice_index for d in row}) == 1, [d.id for d in row]


@pytest.mark.parametrize("case", VALID, ids=_ids)
def test_data_columns_cross_slices_in_one_order(case: tuple[Topology, int]) -> None:
    topo, m = case
    mesh = sh.make_mesh(topo.gpus(), model_axis=m)
    columns = [[d.slice_index for d in mesh.devices[:, j]] for j in range(m)]
    rows_per_slice = topo.per_slice // m
    expected = [s for s in range(topo.slices) for _ in range(rows_per_slice)]
    assert all(column == expected for column in columns)


@pytest.mark.parametrize("case", VALID, ids=_ids)
def test_process_rows_are_blocks_in_process_order_for_the_loader(case: tuple[Topology, int]) -> None:
    topo, m = case
    mesh = sh.make_mesh(topo.gpus(), model_axis=m)
    _assert_loader_order(mesh)
    if m <= topo.per_process:  # each row inside one process: process p holds block p of the batch
        n = mesh.shape["data"] // topo.processes
        assert _process_rows(mesh) == {p: list(range(p * n, (p + 1) * n)) for p in range(topo.processes)}


@pytest.mark.parametrize("case", VALID, ids=_ids)
def test_mesh_is_jax_hybrid_layout_when_slices_follow_process_order(case: tuple[Topology, int]) -> None:
    topo, m = case
    devices = topo.gpus()
    expected = mesh_utils.create_hybrid_device_mesh(
        (topo.per_slice // m, m), (topo.slices, 1), devices)
    assert np.array_equal(sh.make_mesh(devices, model_axis=m).devices, expected)


@pytest.mark.parametrize("model_axis", [1, 2, 4])
def test_slices_numbered_against_process_order_still_give_process_order(model_axis: int) -> None:
    """Slice 0 on the last node and ids reversed inside each node: rows still follow processes."""
    topo = Topology(4, 4, 4)
    devices = [Gpu(topo.devices - 1 - g.id, g.process_index, topo.slices - 1 - g.slice_index)
               for g in topo.gpus()]
    mesh = sh.make_mesh(devices, model_axis=model_axis)
    _assert_loader_order(mesh)
    assert [d.process_index for d in mesh.devices.flat] == sorted(d.process_index for d in devices)
    for row in mesh.devices:
        assert len({d.slice_index for d in row}) == 1


@pytest.mark.parametrize("case", INVALID, ids=_ids)
def test_model_axis_not_dividing_a_slice_is_one_clear_error(case: tuple[Topology, int]) -> None:
    topo, m = case
    with pytest.raises(ConfigError) as err:
        sh.make_mesh(topo.gpus(), model_axis=m)
    message = str(err.value)
    assert f"{topo.per_slice} devices per slice" in message
    assert f"{topo.slices} slices" in message
    assert f"use one of {_divisors(topo.per_slice)}" in message
    assert f"found {m}" in message


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "2"])
def test_model_axis_of_the_wrong_kind_across_slices_is_the_same_error(bad: object) -> None:
    with pytest.raises(ConfigError, match=re.escape("use one of [1, 2, 4]")):
        sh.make_mesh(Topology(2, 4, 4).gpus(), model_axis=bad)  # type: ignore[arg-type]


def test_slices_of_unequal_size_are_one_clear_error() -> None:
    devices = [Gpu(i, i // 8 if i < 8 else 1, 0 if i < 8 else 1) for i in range(12)]
    for build in (lambda: sh.make_mesh(devices), lambda: _device_mesh(devices)):
        with pytest.raises(ConfigError) as err:
            build()
        message = str(err.value)
        assert "the same number of devices in every slice" in message
        assert "slice 0: 8, slice 1: 4" in message
        assert "Fix:" in message


def test_tpu_multislice_stand_ins_give_a_hybrid_mesh() -> None:
    chips = [TpuChip(s * 4 + i, s, s, (i % 2, i // 2, 0)) for s in range(2) for i in range(4)]
    for m in (1, 2, 4):
        mesh = sh.make_mesh(chips, model_axis=m)
        assert dict(mesh.shape) == {"data": 8 // m, "model": m}
        assert set(mesh.devices.flat) == set(chips)
        assert all(len({d.slice_index for d in row}) == 1 for row in mesh.devices)


# ------------------------------------------------------------------------ create_device_mesh


def _device_mesh(devices: list[object]) -> Mesh:
    """create_device_mesh's uncached body, with jax.devices() returning `devices`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax, "devices", lambda *a, **k: list(devices))
        return multihost.create_device_mesh.__wrapped__()


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=str)
def test_create_device_mesh_across_slices_is_1d_in_process_order(topo: Topology) -> None:
    devices = topo.gpus()
    mesh = _device_mesh(devices)
    assert mesh.axis_names == ("devices",)
    assert mesh.axis_types == (AxisType.Auto,)
    assert dict(mesh.shape) == {"devices": topo.devices}
    flat = list(mesh.devices.flat)
    assert sorted(flat, key=lambda d: d.id) == devices
    assert [d.process_index for d in flat] == sorted(d.process_index for d in flat)
    assert [d.slice_index for d in flat] == sorted(d.slice_index for d in flat)


def test_create_device_mesh_is_still_cached() -> None:
    assert multihost.create_device_mesh() is multihost.create_device_mesh()


# ------------------------------------------------------------------------ one slice: unchanged

SINGLE_SLICE = {
    "slice_index-all-0": [Gpu(i, i // 4, 0) for i in range(16)],
    "no-slice_index": [PlainDevice(i, i // 2) for i in range(8)],
    "no-slice_index-ids-unsorted": [PlainDevice(i, i // 4) for i in (3, 1, 2, 0, 7, 5, 6, 4)],
}


@pytest.mark.parametrize("name", [*SINGLE_SLICE, "jax.devices()"])
def test_single_slice_gives_exactly_the_mesh_it_gave_before(name: str) -> None:
    devices = SINGLE_SLICE.get(name) or jax.devices()
    n = len(devices)
    for m in _divisors(n):
        before = jax.make_mesh((n // m, m), ("data", "model"),
                               axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)
        assert sh.make_mesh(devices, model_axis=m) is before
    before = jax.make_mesh((n,), ("devices",), axis_types=(AxisType.Auto,), devices=devices)
    assert _device_mesh(devices) is before


@pytest.mark.parametrize("name", list(SINGLE_SLICE))
def test_single_slice_keeps_its_model_axis_error(name: str) -> None:
    devices = SINGLE_SLICE[name]
    with pytest.raises(ConfigError, match=f"a positive divisor of the device count {len(devices)}"):
        sh.make_mesh(devices, model_axis=3)


@dataclasses.dataclass(frozen=True)
class PartitionedGpu:
    """A GPU as jax 0.11 and later name it: `partition_index` numbers the node."""

    id: int
    process_index: int
    partition_index: int
    platform: str = "gpu"
    device_kind: str = H100

    @property
    def slice_index(self) -> int:  # the deprecated name: reading it is the mistake under test
        raise AssertionError("read slice_index on a device that has partition_index")


@pytest.mark.parametrize("case", VALID, ids=_ids)
def test_devices_numbered_by_partition_index_give_the_slice_index_mesh(case: tuple[Topology, int]) -> None:
    topo, m = case
    old = topo.gpus()
    new = [PartitionedGpu(d.id, d.process_index, d.slice_index) for d in old]
    assert [d.id for d in sh.make_mesh(new, model_axis=m).devices.flat] == \
        [d.id for d in sh.make_mesh(old, model_axis=m).devices.flat]
    assert multihost_mesh_ids(new) == multihost_mesh_ids(old)


def multihost_mesh_ids(devices: list) -> list[int]:
    return [d.id for d in hybrid_mesh(devices, (len(devices),), ("devices",), "test").devices.flat]


# ------------------------------------------------------------------------ named axes (--mesh)


@pytest.mark.parametrize("topo", [Topology(2, 4, 1), Topology(4, 8, 2)], ids=str)
def test_a_named_mesh_across_slices_keeps_every_axis_but_the_first_inside_one_slice(topo: Topology) -> None:
    mesh = sh.make_mesh(topo.gpus(), axes={"data": -1, "expert": 2, "model": 2})
    assert dict(mesh.shape) == {"data": topo.devices // 4, "expert": 2, "model": 2}
    for row in mesh.devices.reshape(mesh.devices.shape[0], -1):  # one data index: an expert x model group
        assert len({d.slice_index for d in row}) == 1, row
    _assert_loader_order(mesh)


def test_a_named_mesh_whose_inner_axes_would_cross_slices_is_one_error_naming_the_flag() -> None:
    topo = Topology(2, 4, 1)
    with pytest.raises(ConfigError) as raised:
        sh.make_mesh(topo.gpus(), axes={"data": 1, "expert": 8})
    assert raised.value.what == "--mesh" and "across the 2 slices or nodes" in raised.value.expected
    assert "a divisor of 4" in raised.value.fix and raised.value.found == "data=1,expert=8"
