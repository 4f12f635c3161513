"""The fit before a slice exists (deploy/tpu/fit.py, job/train/fit.py): the loop's own train step compiled ahead of
time for TPU slices by libtpu on this CPU machine; HBM per chip needed against available; where it does not fit,
one error with each flag checked by compiling it. A run that fits, one that does not (GPT-2 small without remat,
the chip's own out-of-memory), and fsdp over a multi-host slice whose bytes per chip shrink as the chips grow.

Needs libtpu (the tpu-fit extra; CI installs it): without it these tests skip, and JOB_REQUIRE_ALL_TIERS=1 makes
that a failure. The figures of the real chip are in FACTS and bench/RESULTS-tpu.md, not asserted here."""

from __future__ import annotations

import dataclasses
import re

import pytest

from deploy.tpu import doctor
from deploy.tpu import fit as tpu_fit
from deploy.tpu.accelerators import parse_accelerator
from deploy.tpu.config import TpuConfig
from job.train import config, fit, memory
from job.train import task as tasks
from job.runtime import device_memory
from job.runtime.device_memory import GIB
from tests.tpu.harness import ZONE

V5E_HBM = 15.75 * GIB  # what libtpu (and the real chip) says one v5e chip holds


@pytest.fixture(scope="module")
def libtpu() -> str:
    version = tpu_fit.libtpu_version()
    if version is None:
        pytest.skip(f"no libtpu: the fit check compiles for TPU slices with it ({tpu_fit.INSTALL})")
    return version


def request(accelerator: str, *args: str, slices: int = 1) -> TpuConfig:
    return TpuConfig(name="pod-x", zone=ZONE, accelerator=accelerator, job_args=("train", *args), slices=slices,
                     queued=slices > 1)


# ------------------------------------------------------------------------------------------- no libtpu needed
@pytest.mark.parametrize(("accelerator", "name", "chip_config", "bounds"), [
    ("v5litepod-1", "v5e:1x1", "default", (1, 1, 1)), ("v5litepod-4", "v5e:2x2", "default", (2, 2, 1)),
    ("v5litepod-8", "v5e:2x4", "default", (2, 4, 1)), ("v5litepod-16", "v5e:4x4", "default", (2, 2, 1)),
    ("v5litepod-256", "v5e:16x16", "default", (2, 2, 1)), ("v6e-32", "v6e:4x8", "default", (2, 2, 1)),
    ("v4-8", "v4:2x2x1", "megacore", (2, 2, 1)), ("v4-16", "v4:2x2x2", "megacore", (2, 2, 1)),
    ("v4-32", "v4:2x2x4", "megacore", (2, 2, 1)), ("v4-128", "v4:4x4x4", "megacore", (2, 2, 1)),
    ("v5p-64", "v5p:2x4x4", "megacore", (2, 2, 1)),
])
def test_an_accelerator_type_is_the_topology_cloud_tpu_gives_it(accelerator: str, name: str, chip_config: str,
                                                                bounds: tuple[int, int, int]) -> None:
    found = tpu_fit.topology(parse_accelerator(accelerator))
    assert (found.name, found.chip_config, found.host_bounds) == (name, chip_config, bounds)


def test_a_fit_line_that_was_not_checked_is_a_skip_saying_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    no_args = tpu_fit.fit_line(request("v4-8"), check_run=False)
    assert no_args.skipped and not no_args.ok and not no_args.failed
    assert no_args.line().startswith("skip  fit: no ARGS given. To run it: ARGS='train ...'")
    assert tpu_fit.fit_line(request("v3-8")).line() == (
        "skip  fit: the fit is compiled for v4, v5p, v5litepod, v6e, not v3-8")
    sweep = dataclasses.replace(request("v4-8"), sweep="optim.lr=1e-3,3e-3")
    assert tpu_fit.fit_line(sweep).skipped and "not checked for a SWEEP" in tpu_fit.fit_line(sweep).line()
    monkeypatch.setattr(tpu_fit, "libtpu_version", lambda: None)
    no_libtpu = tpu_fit.fit_line(request("v5litepod-1"))
    assert no_libtpu.skipped and not no_libtpu.ok
    assert no_libtpu.line() == (
        "skip  fit: libtpu is not installed here. To run it: .venv/bin/pip install -e '.[tpu-fit]' (libtpu: Linux "
        "x86_64, Python 3.12 or newer) (the train step is then compiled for v5litepod-1 on this machine)")


# ------------------------------------------------------------------------------------------------ with libtpu
@pytest.mark.parametrize(("accelerator", "slices"), [
    ("v5litepod-1", 1), ("v5litepod-8", 1), ("v5litepod-16", 1), ("v6e-16", 1), ("v4-8", 1), ("v4-32", 1),
    ("v5p-16", 1), ("v5litepod-4", 2), ("v4-16", 2),
])
def test_the_compiled_for_devices_are_the_slices_chips_on_its_hosts(libtpu: str, accelerator: str, slices: int) -> None:
    accel = parse_accelerator(accelerator)
    devices = tpu_fit.compile_only_devices(accel, slices)
    assert len(devices) == doctor.devices(request(accelerator, slices=slices)).count  # what the run's check counts
    assert len({device.process_index for device in devices}) == accel.hosts * slices  # one process per worker


def test_a_run_that_fits_is_one_ok_line_with_the_bytes_per_chip(libtpu: str) -> None:
    line = tpu_fit.fit_line(request("v5litepod-4", "--steps", "10")).line()
    match = re.fullmatch(r"ok    fit: the train step needs ([0-9.]+) GiB of HBM per chip, 15\.75 GiB available "
                         rf"\(v5litepod-4: 4 chips \(TPU v5 lite\); compiled ahead of time by libtpu {libtpu} in "
                         r"[0-9]+ s\)", line)
    assert match and 0 < float(match.group(1)) < 1, line  # the tiny LM: some MiB


def test_several_slices_compile_as_one_hybrid_mesh(libtpu: str) -> None:
    line = tpu_fit.fit_line(request("v5litepod-4", "--steps", "10", "--rule", "fsdp", slices=2)).line()
    assert line.startswith("ok    fit: the train step needs ") and "(v5litepod-4: 4 chips x 2 slices (TPU v5 lite)" in line


@pytest.mark.slow
@pytest.mark.timeout(900)  # two compiles of GPT-2 small: about a minute on 2 idle cores, 5 minutes on busy ones
def test_gpt2_small_without_remat_does_not_fit_a_v5e_chip_and_the_error_names_a_remat_that_does(libtpu: str) -> None:
    task = tasks.load("lm")
    # blocks scanned, as on the chip that ran out (unrolled, the preset's default, it needs 15.18 GiB: the edge)
    flags = ["--preset", "gpt2-small", "--model.scan", "--model.remat", "none"]
    if "attention" in {f.name for f in dataclasses.fields(task.model_config)}:
        flags += ["--model.attention", "xla"]  # the kernel the chip ran out with (splash holds no T x T scores)
    cfg = config.parse(flags, task)
    found = fit.step_fits(cfg, task, tpu_fit.target(parse_accelerator("v5litepod-1")), kinds=("remat",))
    assert not found.fits and found.need.available == int(V5E_HBM)
    assert found.need.needed is not None and found.need.needed > 1.2 * V5E_HBM  # the chip said 30.39 GiB (old model)
    dots = found.remedies[0]
    assert dots.flags == ("--model.remat", "dots") and dots.need is not None and dots.need.fits
    assert [r.flags for r in found.remedies] == [("--model.remat", "dots")]  # the first that fits ends its kind
    text = str(found.error())
    assert text.startswith("the train step's memory on v5litepod-1: 1 chip (TPU v5 lite): expected at most 15.75 GiB "
                           f"per device (what it has), found '{device_memory.gib(found.need.needed)} per device (compiled "
                           "ahead of time: RESOURCE_EXHAUSTED: ")
    assert text.endswith(f"Fix: these fit, each compiled for it: --model.remat dots ({device_memory.gib(dots.need.needed)} "
                         "per device)")
    assert doctor.failed("fit", found.error()).line() == f"FAIL  fit: {text}"  # the doctor's line: the same text


@pytest.mark.slow
def test_under_fsdp_the_bytes_per_chip_shrink_as_a_multi_host_slice_grows(libtpu: str) -> None:
    task = tasks.load("lm")
    # a state that outweighs the activations: 3.7M parameters (15 MB, three times that with Adam's moments)
    cfg = config.parse(["--rule", "fsdp", "--model.vocab-size", "4096", "--model.dim", "256", "--model.mlp-dim",
                        "1024", "--data.global-batch", "16"], task)
    small, large = (tpu_fit.target(parse_accelerator(a)) for a in ("v4-16", "v4-32"))  # 8 chips on 2 hosts, 16 on 4
    found = fit.scaling(cfg, task, small, large)
    assert found is not None and found.small_need.fits and found.large_need.fits, found
    assert found.small_need.needed and found.large_need.needed
    assert found.large_need.needed < 0.75 * found.small_need.needed and found.falls, found
    assert found.line().startswith("the step's bytes fall with the rows: ")


SMALL_LLAMA = ("--model.dim", "256", "--model.mlp", "512", "--model.seq-len", "256", "--model.vocab", "1024",
               "--rule", "fsdp", "--data.global-batch", "32")


def test_a_model_whose_activations_stay_whole_under_fsdp_is_named_with_the_call_that_fixes_it(libtpu: str) -> None:
    """A user's model that annotates only its parameters (tests/user_tasks/llama.py, as written): under fsdp XLA
    lays its activations out as the parameters, along 'embed', and every chip keeps every row, so 4 times the chips
    hardly change its bytes per chip. The same model through job.kernels.remat keeps its blocks' inputs split by
    rows (measured for the 153M preset, batch 16: 27.64 GiB on one chip, 21.24 per chip on v5litepod-8 as written;
    6.35 and 1.21 after the documented lines)."""
    task = tasks.load("tests.user_tasks.llama:TASK")
    cfg = config.parse(["--task", "tests.user_tasks.llama:TASK", "--model.no-remat", *SMALL_LLAMA], task)
    small, large = (tpu_fit.target(parse_accelerator(a)) for a in ("v5litepod-4", "v5litepod-16"))
    whole = fit.scaling(cfg, task, small, large)
    assert whole is not None and not whole.falls, whole
    assert "a larger slice does not help this run" in whole.line() and "job.kernels.remat(call, policy)" in whole.line()
