"""A process whose peak resident memory is the figure: `python -m job ARGS`, or a bare JAX process.

    python -m job.launch -n 4 -- python -m bench.peak train --run-dir D ...   # the training job
    python -m job.launch -n 4 -- python -m bench.peak bare                    # job.initialize + one psum

Each process prints one record (`bench.procs.emit`) as it exits: its rank, exit code and peak RSS.
"""

from __future__ import annotations

import sys


def _bare() -> int:
    import jax
    import jax.numpy as jnp

    import job

    job.initialize()
    total = jax.jit(jnp.sum)(jnp.ones(jax.device_count()))
    return 0 if int(total) == jax.device_count() else 1


def main(argv: list[str]) -> int:
    from bench.procs import emit, peak_rss_bytes

    if argv[:1] == ["bare"]:
        code = _bare()
    else:
        from job import __main__ as entry

        code = entry.main(argv)
    import jax

    emit({"rank": jax.process_index(), "exit": code, "peak_rss_mib": peak_rss_bytes() / 2**20})
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
