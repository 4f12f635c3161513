"""Benchmarks of the template against hand-written JAX: figures, never assertions.

    make bench                 # = python -m bench: all of them, writes bench/RESULTS.md + launch_scaling.png
    python -m bench --quick    # smoke run
    python -m bench.step       # one of them, printed

| module | what it compares |
|---|---|
| step | the example train step through the template vs a hand-written `jax.jit` data-parallel step |
| scaling | `job.launch` + `job.initialize` vs a Popen loop + `jax.distributed.initialize`, 1..32 processes |
| hostsync | `job.multihost` sync helpers vs the raw `multihost_utils` calls, 4 and 16 processes |
| ckpt | the template's save (blocking time against the step and the device-to-host copy, every step beside the write) vs plain orbax's async save; save and restore vs numpy (synced) and the disk's synced rate (bench/ckpt/) |
| pipeline | global batch assembly vs the train step (input stall) |
| mfu | model FLOPs utilisation of a GPT-2-small-sized example LM on one GPU (skipped without one) |
| growth | the loop's train step and checkpoint save vs model size (3 sizes) and process count (1..8, weak scaling) |
| compile_cache | time to the first step of `python -m job train` with the persistent compilation cache cold vs warm |
| fingerprint | the summary's parameter fingerprint (reduced where each shard lives) vs gathering every leaf to every process and hashing |
| records | an .arrayrecord token file read through grain: grain's multi-process workers vs the loop's prefetch thread (input stall, rows per second and per CPU second) |
| scale | peak memory per process of the LM replicated vs fsdp (state created as its shards), vs --accum-steps and --model.remat, and the ~1B LM under fsdp |
| depth | time to the first step at 2, 8 and 32 layers and peak memory by --model.remat policy, the LM's blocks scanned vs unrolled |
| experts | a mixture of experts' expert kernels and Adam moments per device, and its step time, with the experts split over an expert axis of 4 vs replicated (4 CPU devices) |
| recovery | on the local Slurm cluster, a killed process: the restart gap and steps redone for a requeue, a restart in the allocation on a spare, and one with the node-local tier |
| preemption | the preemption check after each step: the coordination service's sync point vs the all-gather of a flag it replaced, on 4 processes |
| tiers | a 1.5 GB sharded state: the persistent tier on disk (writes synced, page cache dropped before restores) vs plain orbax and numpy; the node-local tier in /dev/shm vs numpy |

On a chip, by hand (not in BENCHMARKS; the ckpt ones write OUT/NAME.json, and `--small` is their CPU-sized dry run):

| module | what it compares |
|---|---|
| ckpt.options | `python -m bench.ckpt.options OUT`: the disk's rates, orbax's fixed cost, each orbax option's whole write vs numpy, restore warm and cold |
| ckpt.beside | `python -m bench.ckpt.beside OUT`: steps beside a save of fresh arrays by mechanism, the loop's blocked time vs the device-to-host link's rate + 0.2 s |
| tpu | `python -m bench.tpu`: the example LM on the chip, bench/RESULTS-tpu.md |

Every figure is a ratio against a baseline measured in the same run, the
median of interleaved repetitions (`bench.timing`).
"""

BENCHMARKS = ("step", "scaling", "hostsync", "ckpt", "pipeline", "mfu", "growth", "compile_cache", "fingerprint", "scale", "records", "depth",
              "experts", "tiers", "recovery", "preemption")
