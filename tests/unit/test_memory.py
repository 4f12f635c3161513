"""An out-of-memory of the train step is one error (job/train/memory.py): the bytes from each of XLA's messages, the
flags named from the figures, and the loop's context turning XLA's error into one ConfigError with no traceback.
Compiling for a TPU, where each flag is checked, is the TPU tier's (tests/tpu/test_fit.py: it needs libtpu)."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from job.core.errors import ConfigError
from job.parallel import sharding
from job.train import config, memory
from job.train import task as tasks
from job.runtime import device_memory
from job.runtime.device_memory import GIB, Need

# as the chip said it (a TPU v5e, JAX 0.10.2), and as libtpu 0.0.50 says it compiling ahead of time
ON_THE_CHIP = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (30.39G) "
               "exceeds available HBM (15.75G). HLO module: jit_train_step_fn.")
AHEAD = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (29.26G) exceeds available HBM (15.75G). HLO module: jit_train_step_fn.\nSee https://openxla.org")

# a later step's program that no longer fits beside what is in use (a v5e chip, when saves copied on the device);
# the runtime raises it as a ValueError
PROGRAM_LOAD = ("RuntimeProgramAllocationFailure: Attempting to reserve 13.81G at the bottom of memory. That was not "
                "possible. There are 12.33G free, 0B reserved, and 0B reservable.")


@pytest.mark.parametrize(("text", "needed", "available"), [
    (ON_THE_CHIP, 30.39 * GIB, 15.75 * GIB),
    (AHEAD, 29.26 * GIB, 15.75 * GIB),
    ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.77G of 15.48G hbm. Exceeded hbm capacity "
     "by 5.29G.", 20.77 * GIB, 15.48 * GIB),
    # libtpu 0.0.50 for GPT-2 small at --accum-steps 2: the use capped at the capacity, the total below it
    ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in memory "
     "space hbm. Used 15.75G of 15.75G hbm. Exceeded hbm capacity by 6.69M.\n\nTotal hbm usage >= 16.01G:\n"
     "    reserved        258.00M \n", 16.01 * GIB, 15.75 * GIB),
    ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 15.75G of 15.75G hbm. Exceeded hbm capacity "
     "by 1.00G.", 16.75 * GIB, 15.75 * GIB),
    ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.50G. That was not possible. "
     "There are 800.00M free.", 1.5 * GIB, 800 * (1 << 20)),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2147483648 bytes.", 2 * GIB, None),
    (PROGRAM_LOAD, 13.81 * GIB, 12.33 * GIB),
])
def test_each_of_xlas_messages_gives_the_bytes_needed_and_available(text: str, needed: float, available: float | None
                                                                      ) -> None:
    need = device_memory.from_message(text)
    assert not need.fits
    assert need.needed == pytest.approx(needed, rel=1e-3)  # the message gives 2 decimals
    assert need.available == (None if available is None else pytest.approx(available, rel=1e-3))
    assert "\n" not in need.said and need.said.startswith(("RESOURCE_EXHAUSTED", "RuntimeProgramAllocationFailure"))
    assert len(need.said) <= device_memory.SHOWN


def test_only_xlas_out_of_memory_counts_as_one() -> None:
    assert device_memory.is_out_of_memory(jax.errors.JaxRuntimeError(AHEAD))
    assert device_memory.is_out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: Out of memory while trying to allocate 8 bytes"))
    assert not device_memory.is_out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: Mosaic failed to compile the kernel"))
    assert not device_memory.is_out_of_memory(MemoryError("RESOURCE_EXHAUSTED"))  # Python's own: not the device's


def gpt2_small(*flags: str) -> config.TrainConfig:
    task = tasks.load("lm")
    return config.parse(["--preset", "gpt2-small", "--model.remat", "none", *flags], task)


def test_the_flags_named_shrink_what_a_device_holds_by_what_it_is_over() -> None:
    cfg, task = gpt2_small(), tasks.load("lm")
    need = Need(False, int(12 * GIB), int(15.75 * GIB // 1.5))  # 1.5x what it has (1.9x with the margin): half
    named = {r.flags[0]: r for r in memory.suggested(cfg, task, devices=1, data_parallel=1, need=need)}
    assert [" ".join(r.flags) for r in named.values()] == [
        "--model.remat full", "--accum-steps 2", "--data.global-batch 8", "--rule fsdp"]
    assert named["--rule"].devices == 2 and named["--rule"].line().startswith("--rule fsdp on 2x the devices")
    chip = Need(False, int(28.37 * GIB), int(15.75 * GIB))  # the chip's: 1.8x, and half the rows needed 16.01 GiB
    named = {r.flags[0]: r for r in memory.suggested(cfg, task, devices=1, data_parallel=1, need=chip)}
    assert [" ".join(r.flags) for r in named.values()] == [
        "--model.remat full", "--accum-steps 4", "--data.global-batch 4", "--rule fsdp"]
    assert all(r.need is None for r in named.values())  # named, not checked
    for remedy in named.values():  # each is a config the run's own checks take
        config.validate(remedy.cfg, task)
    far = Need(False, int(90 * GIB), int(15.75 * GIB))  # over five times (seven with the margin): an eighth
    named = {r.flags[0]: r for r in memory.suggested(cfg, task, devices=4, data_parallel=4, need=far)}
    assert named["--accum-steps"].flags == ("--accum-steps", "4")  # 16 rows over 4 devices: at most 4 micro-batches
    assert named["--data.global-batch"].flags == ("--data.global-batch", "4")
    assert named["--rule"].devices == 32


def test_remat_is_named_only_for_a_model_config_that_has_it_and_takes_the_value() -> None:
    cfg, task = gpt2_small(), tasks.load("lm")
    assert [r.flags for r in memory.remat_remedies(cfg, task)] == [("--model.remat", "dots"), ("--model.remat", "full")]
    full = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="full"))
    assert [r.flags for r in memory.remat_remedies(full, task)] == [("--model.remat", "dots")]

    @dataclasses.dataclass(frozen=True)
    class Plain:
        dim: int = 4

    assert list(memory.remat_remedies(dataclasses.replace(cfg, model=Plain()), task)) == []


def test_the_error_states_the_bytes_against_the_devices_and_the_flags() -> None:
    cfg, task = gpt2_small(), tasks.load("lm")
    need = device_memory.from_message(AHEAD)
    named = memory.suggested(cfg, task, devices=1, data_parallel=1, need=need)
    error = memory.error(need, named, "1 device (TPU v5 lite)", "compiling the train step", checked=False,
                         unchecked="make tpu-doctor checks them")
    text = str(error)
    assert "\n" not in text
    assert text.startswith("the train step's memory on 1 device (TPU v5 lite): expected at most 15.75 GiB per device")
    assert "found '29.26 GiB per device (compiling the train step: RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom" in text
    assert ". Fix: flags that may fit (not checked here; make tpu-doctor checks them): --model.remat full (" in text
    assert "--accum-steps 4 (the same batch of 16 as 4 micro-batches of 4)" in text
    assert "exceeds available HBM (15.75G). HLO module: jit_train_step_fn.)'" in text  # the compiler's sentence whole
    fits = [dataclasses.replace(r, need=Need(True, 7 * GIB, int(15.75 * GIB))) for r in named[:2]]
    checked = str(memory.error(need, fits, "v5litepod-1", "compiled ahead of time", checked=True))
    assert checked.endswith("Fix: these fit, each compiled for it: --model.remat full (7.00 GiB per device); "
                            "--accum-steps 4 (7.00 GiB per device)")
    tight = [dataclasses.replace(named[0], need=Need(False, 20 * GIB, int(15.75 * GIB)))]
    assert "Fix: none of the flags tried fits (--model.remat full (20.00 GiB per device)): a larger slice" in str(
        memory.error(need, tight, "v5litepod-1", "compiled ahead of time", checked=True))


def test_the_loops_out_of_memory_leaves_as_one_config_error() -> None:
    cfg, task = gpt2_small(), tasks.load("lm")
    mesh = sharding.make_mesh(jax.devices()[:1])
    with pytest.raises(ConfigError) as caught, memory.one_error(cfg, task, mesh, "compiling the train step"):
        raise jax.errors.JaxRuntimeError(ON_THE_CHIP)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no chained traceback
    assert str(caught.value).startswith("the train step's memory on 1 device (cpu): expected at most 15.75 GiB")
    assert "found '30.39 GiB per device (compiling the train step: RESOURCE_EXHAUSTED" in str(caught.value)
    assert "make tpu-doctor" not in str(caught.value)  # a CPU: the ahead-of-time check is for TPU slices
    with pytest.raises(jax.errors.JaxRuntimeError), memory.one_error(cfg, task, mesh, "its first step"):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")  # not an out-of-memory: as it was


def test_a_program_that_cannot_load_at_a_later_step_lets_the_save_finish_then_is_one_error() -> None:
    cfg, task = gpt2_small(), tasks.load("lm")
    mesh = sharding.make_mesh(jax.devices()[:1])
    order: list[str] = []
    with pytest.raises(ConfigError) as caught, memory.one_error(cfg, task, mesh, "step 51",
                                                                before=lambda: order.append("save finished")):
        raise ValueError(PROGRAM_LOAD)
    assert order == ["save finished"] and caught.value.__suppress_context__
    assert "found '13.81 GiB per device (step 51: RuntimeProgramAllocationFailure" in str(caught.value)
    with pytest.raises(ValueError, match="not ours"), memory.one_error(cfg, task, mesh, "step 2", before=order.clear):
        raise ValueError("not ours")  # any other ValueError: as it was, the save left alone
    assert order == ["save finished"]
