"""The lm task's named experiments: `python -m job train --preset NAME` (flags given beside it win).

Each preset's docstring is the command that runs it, as big_vision's configs say theirs.
"""

from __future__ import annotations

from job.tasks.lm.data import DataConfig
from job.tasks.lm.model import ModelConfig


def tiny() -> tuple[ModelConfig, DataConfig]:
    """The defaults: 104,768 parameters on the synthetic reverse task, minutes on a laptop's CPU.

        make run-local ARGS="train --preset tiny"
    """
    return ModelConfig(), DataConfig()


def gpt2_small() -> tuple[ModelConfig, DataConfig, dict]:
    """GPT-2 small's shape (123.5M parameters in its matmuls, 163M with the untied head), bf16 compute,
    global batch 16 x 1024 tokens, with GPT-2's optimizer settings (peak lr 6e-4 after 100 warmup steps,
    b2 0.95, weight decay 0.1) over 1,000 steps. On one TPU v5e chip it trains as it is (splash attention,
    remat dots chosen for the chip's 16 GB, its 12 blocks unrolled: a step of 142 ms against 164 ms scanned,
    for a compile of 29 s against 11 s: bench/RESULTS-tpu.md); its synthetic data is the reverse task
    scaled to it: 64 symbols of 256 reversed a row, which it learns within the run (accuracy on the
    reversed positions above 0.9). Real text: a token file (bench/corpus.py makes one offline).

        python -m job train --preset gpt2-small
        python -m job train --preset gpt2-small --data.source tokens.npy --steps 5000
    """
    return (ModelConfig(vocab_size=50304, seq_len=1024, dim=768, heads=12, layers=12, mlp_dim=3072,
                        dtype="bfloat16", scan=False),
            DataConfig(global_batch=16, reverse_len=64, symbols=256),
            {"steps": 1000, "eval_every": 100, "log_every": 20,
             "optim": {"lr": 6e-4, "warmup_steps": 100, "b2": 0.95, "weight_decay": 0.1},
             "ckpt": {"every": 500}})


def lm_1b() -> tuple[ModelConfig, DataConfig]:
    """The ~1B LM of the largest-model benchmark (bench/scale.py): 1.01B parameters, its 20 blocks
    scanned with full remat (each keeps only its input for the backward pass), trained under fsdp;
    its float32 state (parameters and both Adam moments) is 12 GB, a quarter of it on each of 4
    processes.

        python -m job.launch -n 4 -- python -m job train --preset 1b --rule fsdp --steps 2
    """
    return (ModelConfig(vocab_size=256, dim=2048, heads=16, layers=20, mlp_dim=8192, remat="full"),
            DataConfig(global_batch=4))


PRESETS = {"tiny": tiny, "gpt2-small": gpt2_small, "1b": lm_1b}
