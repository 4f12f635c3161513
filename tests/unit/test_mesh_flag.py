"""`--mesh` read and checked in one place (job/parallel/mesh_flag.py): its syntax, its axis names with a typo's
nearest name, its sizes against the devices with a size that divides, the model axis, across slices; and
`python -m job train` refusing each before anything starts. Needs no devices: the module imports no jax."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from job import sharding as sh
from job.errors import ConfigError
from job.parallel import mesh_flag
from tests import launching


def test_the_mesh_flag_is_read_without_jax() -> None:
    proc = launching.run([sys.executable, "-c", "import sys; from job.parallel import mesh_flag; "
                          "from job.train import config; print('jax' in sys.modules)"])
    assert proc.returncode == 0 and proc.stdout.strip() == "False", launching.explain(proc)


def test_the_public_faces_parse_mesh_and_mesh_shape_are_the_flags_own() -> None:
    assert sh.parse_mesh is mesh_flag.parse_mesh and sh.mesh_shape is mesh_flag.mesh_shape


@pytest.mark.parametrize(("text", "axes"), [
    ("data=4,expert=2", {"data": 4, "expert": 2}),
    (" data = -1 , model=2", {"data": -1, "model": 2}),  # spaces around words and signs
    ("expert=2,data=-1", {"expert": 2, "data": -1}),  # in the order given: the first axis spans the slices
])
def test_the_mesh_text_parses_to_named_axes_in_order(text: str, axes: dict) -> None:
    parsed = mesh_flag.parse_mesh(text)
    assert parsed == axes and list(parsed) == list(axes)


@pytest.mark.parametrize(("text", "devices", "shape"), [
    ("data=4,expert=2", 8, {"data": 4, "expert": 2}),
    ("data=-1,expert=2", 8, {"data": 4, "expert": 2}),
    ("data=2, model=-1", 8, {"data": 2, "model": 4}),
    ("sequence=8", 8, {"sequence": 8}),
])
def test_a_mesh_flag_names_axes_and_sizes_with_one_minus_one_for_the_rest(text: str, devices: int,
                                                                          shape: dict) -> None:
    assert sh.mesh_shape(sh.parse_mesh(text), devices) == shape


@pytest.mark.parametrize(("text", "devices", "fix"), [
    ("data=-1,model=3", 4, "model=3 does not divide 4 devices; e.g. --mesh data=-1,model=2"),
    ("data=2,model=3", 8, "model=3 does not divide the 4 devices the axes before it leave; e.g. --mesh data=2,model=-1"),
    ("data=-1,expert=4,model=4", 8,
     "model=4 does not divide the 2 devices the axes before it leave; e.g. --mesh data=-1,expert=4,model=2"),
    ("data=2,model=2", 8, "give one axis -1 (the devices the others leave), e.g. --mesh data=-1,model=2"),
])
def test_a_mesh_size_that_does_not_divide_the_devices_is_named_with_a_divisor_in_the_fix(
        text: str, devices: int, fix: str) -> None:
    with pytest.raises(ConfigError) as raised:
        sh.mesh_shape(sh.parse_mesh(text), devices)
    assert raised.value.fix == fix
    suggested = fix.rpartition("--mesh ")[2]
    assert sh.mesh_shape(sh.parse_mesh(suggested), devices)  # the fix's mesh fits


def test_a_mesh_axis_the_task_declares_is_accepted_and_one_nobody_maps_to_is_refused() -> None:
    from job.train import config
    from job.train import task as tasks

    lm, own = tasks.load("lm"), tasks.load("tests.user_tasks.own_axis:TASK")  # own: "hidden" over "width"
    cfg = dataclasses.replace(config.defaults(lm), mesh="data=2,width=2")
    with pytest.raises(ConfigError) as raised:
        config.validate(cfg, lm)
    assert raised.value.what == "--mesh" and raised.value.found == "axis 'width' in 'data=2,width=2'"
    assert "did you mean" not in raised.value.fix and "logical_axes={'mlp': {'tensor': 'width'}}" in raised.value.fix
    config.validate(dataclasses.replace(config.defaults(own), mesh="data=2,width=2", rule="tensor"), own)
    config.validate(dataclasses.replace(cfg, mesh="data=2,expert=2,sequence=1,model=1"), lm)  # the presets' axes


@pytest.mark.parametrize(("mesh", "fix"), [
    ("data=2,modle=2", "did you mean 'model'? --mesh data=2,model=2"),  # the name meant, nothing else
    ("model=2,modle=2", "drop modle=2 (the mesh already has the axis it is close to), or declare it in the task, "
                        "e.g. logical_axes={'mlp': {'tensor': 'modle'}}"),  # never a second model axis
])
def test_a_mesh_typo_is_told_the_name_it_meant_and_never_an_axis_the_mesh_already_has(mesh: str, fix: str) -> None:
    from job.train import config
    from job.train import task as tasks

    lm = tasks.load("lm")
    with pytest.raises(ConfigError) as raised:
        config.validate(dataclasses.replace(config.defaults(lm), mesh=mesh), lm)
    assert raised.value.fix == fix


@pytest.mark.parametrize(("flags", "said"), [
    (("--mesh", "data=2,modle=2", "--rule", "tensor"),
     "found \"axis 'modle' in 'data=2,modle=2'\". Fix: did you mean 'model'? --mesh data=2,model=2"),
    (("--task", "tests.user_tasks.own_axis:TASK", "--mesh", "data=2,widht=2", "--rule", "tensor"),
     "Fix: did you mean 'width'? --mesh data=2,width=2"),  # the task's own axis is a known name
    (("--mesh", "data=-1,model=3"), "Fix: model=3 does not divide 4 devices; e.g. --mesh data=-1,model=2"),
])
def test_python_m_job_train_refuses_a_mesh_that_would_not_split_as_asked_in_one_error(
        flags: tuple[str, ...], said: str, tmp_path: Path) -> None:
    proc = launching.run([sys.executable, "-m", "job", "train", *flags, "--steps", "2", "--run-dir",
                          str(tmp_path / "run")], XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert proc.returncode == 2, launching.explain(proc)
    errors = [line for line in proc.stderr.splitlines() if "--mesh:" in line]
    assert len(errors) == 1 and said in errors[0] and "Traceback" not in proc.stderr, launching.explain(proc)
    assert not list((tmp_path / "run").glob("checkpoints/*")), "nothing trained, nothing saved"


@pytest.mark.parametrize(("text", "said"), [
    ("data=4,data=2", "distinct NAME=SIZE words"), ("data", "distinct NAME=SIZE words"),
    ("data=0", "axis 'data' of a size >= 1, or -1"), ("data=two", "axis 'data' of a size >= 1"),
    ("data=-1,model=-1", "-1 for one axis at most"), ("4=data", "distinct NAME=SIZE words"),
])
def test_a_bad_mesh_flag_is_one_error_with_the_fix(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said) as raised:
        sh.parse_mesh(text)
    assert raised.value.what == "--mesh" and "--mesh data=-1,expert=2" in raised.value.fix



def test_a_mesh_whose_sizes_do_not_multiply_to_the_devices_names_the_count_and_a_fix() -> None:
    with pytest.raises(ConfigError) as raised:
        sh.mesh_shape(sh.parse_mesh("data=3,expert=2"), 8)
    assert str(raised.value) == ("--mesh: expected axis sizes whose product is the job's 8 devices, found "
                                 "'data=3,expert=2'. Fix: data=3 does not divide 8 devices; e.g. "
                                 "--mesh data=-1,expert=2")


def test_a_size_check_names_the_caller_it_is_asked_for_and_one_device_in_the_singular() -> None:
    with pytest.raises(ConfigError) as raised:
        mesh_flag.mesh_shape({"data": 2}, 1, what="sweep run 'x'")
    assert raised.value.what == "sweep run 'x'" and raised.value.expected.endswith("the job's 1 device")
    assert raised.value.found == "data=2" and raised.value.fix == "data=2 does not divide 1 device; e.g. --mesh data=-1"


@pytest.mark.parametrize(("mesh", "model_axis", "axes"), [
    ("", 1, {"data": -1, "model": 1}), ("", 4, {"data": -1, "model": 4}),
    ("data=2,expert=2", 1, {"data": 2, "expert": 2}),
])
def test_the_runs_axes_are_the_mesh_flags_else_data_and_model_of_model_axis(mesh: str, model_axis: int,
                                                                            axes: dict) -> None:
    assert mesh_flag.run_axes(mesh, model_axis) == axes


@pytest.mark.parametrize(("mesh", "fix"), [
    ("data=4", "drop --model-axis and name the axis in the mesh: --mesh data=4,model=2"),
    ("data=2,model=2", "drop --model-axis"),  # the mesh names it already
])
def test_mesh_and_model_axis_together_is_one_error_naming_both(mesh: str, fix: str) -> None:
    with pytest.raises(ConfigError) as raised:
        mesh_flag.run_axes(mesh, 2)
    assert raised.value.what == "--model-axis" and raised.value.found == f"--model-axis 2 --mesh {mesh}"
    assert raised.value.expected == "no --model-axis with --mesh (the mesh names every axis)"
    assert raised.value.fix == fix


def test_a_typo_in_an_axis_name_is_named_with_what_is_expected_and_the_name_it_meant() -> None:
    with pytest.raises(ConfigError) as raised:
        mesh_flag.check_names({"data": -1, "modle": 2}, "data=-1,modle=2", None)
    assert raised.value.what == "--mesh" and raised.value.found == "axis 'modle' in 'data=-1,modle=2'"
    assert raised.value.expected == ("axes that a rule maps a logical axis to: data, model, expert, sequence (or "
                                     "one the task declares in Task.logical_axes)")
    assert raised.value.fix == "did you mean 'model'? --mesh data=-1,model=2"


def test_an_axis_a_task_declares_is_a_known_name_and_the_nearest_for_its_typo() -> None:
    declared = {"hidden": {"tensor": "width"}, "rows": {"fsdp": ("data", "stage"), "tensor": None}}
    mesh_flag.check_names({"data": 2, "width": 2, "stage": 1}, "data=2,width=2,stage=1", declared)
    with pytest.raises(ConfigError) as raised:
        mesh_flag.check_names({"data": 2, "widht": 2}, "data=2,widht=2", declared)
    assert "data, model, expert, sequence, width, stage (or one" in raised.value.expected
    assert raised.value.fix == "did you mean 'width'? --mesh data=2,width=2"


@pytest.mark.parametrize(("axes", "size"), [
    ({"data": -1, "model": 4}, 4), ({"data": -1, "expert": 2}, 1), ({"data": 2, "model": -1}, 1),
])
def test_the_model_size_a_task_validates_against_is_one_without_a_fixed_model_axis(axes: dict, size: int) -> None:
    assert mesh_flag.model_size(axes) == size


@pytest.mark.parametrize(("model_axis", "per_slice", "slices", "expected", "fix"), [
    (3, 8, 1, "a positive divisor of the device count 8", "use one of [1, 2, 4, 8]"),
    (0, 8, 1, "a positive divisor of the device count 8", "use one of [1, 2, 4, 8]"),
    (True, 8, 1, "a positive divisor of the device count 8", "use one of [1, 2, 4, 8]"),
    (1, 0, 1, "a positive divisor of the device count 0", "use one of []"),
    (8, 4, 2, "a positive divisor of the 4 devices per slice (2 slices of 4 devices; a model group must stay "
              "inside one slice)", "use one of [1, 2, 4]"),
])
def test_a_model_axis_that_does_not_divide_one_slices_devices_is_named_with_the_divisors(
        model_axis: object, per_slice: int, slices: int, expected: str, fix: str) -> None:
    with pytest.raises(ConfigError) as raised:
        mesh_flag.check_model_axis(model_axis, per_slice, slices, "make_mesh(model_axis=...)")
    assert raised.value.what == "make_mesh(model_axis=...)" and raised.value.found == model_axis
    assert raised.value.expected == expected and raised.value.fix == fix
    mesh_flag.check_model_axis(4, 8, 2, "make_mesh(model_axis=...)")  # a divisor: no error


@pytest.mark.parametrize(("shape", "fix"), [
    ({"data": 1, "expert": 8}, "put the axis that spans nodes first and keep the product of the others a divisor "
                               "of 4, e.g. --mesh data=-1,expert=..."),
    ({"data": 3}, "make data a multiple of 2"),
])
def test_a_mesh_whose_inner_axes_would_cross_slices_is_named_with_the_fix(shape: dict, fix: str) -> None:
    with pytest.raises(ConfigError) as raised:
        mesh_flag.check_slices(shape, 4, 2)
    assert raised.value.what == "--mesh" and "across the 2 slices or nodes" in raised.value.expected
    assert raised.value.found == ",".join(f"{n}={s}" for n, s in shape.items()) and raised.value.fix == fix
    mesh_flag.check_slices({"data": 4, "expert": 2}, 4, 2)  # data across the slices, expert inside one: fine


@pytest.mark.parametrize(("mesh", "model_axis", "per_slice", "slices", "shape"), [
    ("", 2, 8, 1, {"data": 4, "model": 2}), ("", 4, 4, 2, {"data": 2, "model": 4}),
    ("data=-1,expert=2", 1, 8, 1, {"data": 4, "expert": 2}), ("data=-1,expert=2", 1, 4, 2, {"data": 4, "expert": 2}),
])
def test_the_runs_shape_on_its_devices_is_the_mesh_flags_else_data_and_model_of_model_axis(
        mesh: str, model_axis: int, per_slice: int, slices: int, shape: dict) -> None:
    assert mesh_flag.run_shape(mesh, model_axis, per_slice, slices) == shape


def test_a_model_axis_that_does_not_fit_the_devices_at_hand_names_the_users_flag_and_its_fix() -> None:
    with pytest.raises(ConfigError) as one_slice:
        mesh_flag.run_shape("", 3, 8)
    assert str(one_slice.value) == ("--model-axis: expected a positive divisor of the device count 8, found 3. "
                                    "Fix: pass --model-axis one of [1, 2, 4, 8]")
    with pytest.raises(ConfigError) as two_slices:
        mesh_flag.run_shape("", 8, 4, 2)  # a model group never crosses slices
    assert two_slices.value.what == "--model-axis" and two_slices.value.fix == "pass --model-axis one of [1, 2, 4]"
    assert "4 devices per slice (2 slices of 4 devices" in two_slices.value.expected


def test_a_mesh_that_does_not_fit_the_devices_at_hand_names_the_mesh_flag() -> None:
    with pytest.raises(ConfigError) as raised:
        mesh_flag.run_shape("data=-1,model=3", 1, 8)
    assert raised.value.what == "--mesh" and raised.value.fix == "model=3 does not divide 8 devices; e.g. --mesh data=-1,model=2"
    with pytest.raises(ConfigError) as raised:
        mesh_flag.run_shape("data=1,expert=8", 1, 4, 2)  # expert would cross the slices
    assert raised.value.what == "--mesh" and "across the 2 slices or nodes" in raised.value.expected
    with pytest.raises(ConfigError) as raised:
        mesh_flag.run_shape("data=4", 2, 8)  # both flags: the same error as validate's
    assert raised.value.what == "--model-axis" and raised.value.fix.startswith("drop --model-axis")


def test_a_job_known_by_its_device_count_gets_the_same_choice_between_the_flags() -> None:
    assert mesh_flag.counted_shape("", 2, 8) == {"data": 4, "model": 2}
    assert mesh_flag.counted_shape("data=-1,expert=2", 1, 8) == {"data": 4, "expert": 2}
    with pytest.raises(ConfigError) as raised:
        mesh_flag.counted_shape("", 3, 8)
    assert str(raised.value) == ("--model-axis: expected a divisor of the job's 8 devices, found 3. Fix: pass "
                                 "--model-axis one of [1, 2, 4, 8]")


def test_the_flag_that_set_the_runs_mesh_is_spelled_as_the_user_typed_it() -> None:
    assert mesh_flag.flag_text("data=-1,expert=2", 1) == "--mesh data=-1,expert=2"
    assert mesh_flag.flag_text("", 4) == "--model-axis 4"


def test_only_the_mesh_flags_module_words_the_model_axis_fix() -> None:
    # one owner of the choice between --mesh and --model-axis: no other module writes the fix, nor rewrites it
    root = Path(__file__).resolve().parents[2]
    others = [path.relative_to(root).as_posix() for top in ("job", "deploy") for path in sorted((root / top).rglob("*.py"))
              if path.name != "mesh_flag.py" and any(text in path.read_text() for text in (
                  "--model-axis one of", "use one of {divisors}", '.replace("use one of"'))]
    assert not others, others
