"""Checkpoint benchmarks: the template's save and restore against numpy, plain orbax, the disk and the link.

    python -m bench.ckpt [--quick]              # the save bench on 2 CPU devices (`python -m bench` runs it: "ckpt")
    python -m bench.ckpt.options OUT [--small]  # on a TPU VM: the disk, each orbax option's write, restore warm/cold
    python -m bench.ckpt.beside OUT [--small]   # on a TPU VM: steps beside a save of fresh arrays, the link's rate

| module | what it holds |
|---|---|
| save | the save bench: blocked time, steps beside the write, whole write, restore (`main`; `python -m bench.ckpt`) |
| options | on a chip: the disk's rates, the fixed cost, each orbax option's whole write, restore warm and cold (`main`) |
| beside | on a chip: steps beside a save by mechanism, the loop's blocked time against the device-to-host link (`main`) |
| baseline | what they are measured against: numpy's synced write and read, the device-to-host copy, the page cache dropped |
| disk | the one disk probe: the synced write rate (and cached write, warm and cold read) |
| chip_state | what options and beside share: a gpt2-small-shaped state, orbax with the template's handler, a matmul step |

bench.tiers, bench.scale, bench.storage and bench.tpu use baseline, disk and save's train state. Importing any of
them runs nothing.
"""

from bench.procs import run_worker
from bench.report import Section

NAME = "ckpt"
TITLE = "4. Checkpointing: async orbax save/restore vs step time and numpy"


def run(quick: bool = False) -> Section:
    """`python -m bench`'s entry: the save bench (bench.ckpt.save) in a fresh process with 2 CPU devices."""
    return Section.from_dict(run_worker("bench.ckpt", ["--quick"] if quick else [], devices=2))
