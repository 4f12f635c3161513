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

    stats = jax.local_devices()[0].memory_stats() or {}
    device_peak = stats.get("peak_bytes_in_use")
    emit({"rank": jax.process_index(), "exit": code, "peak_rss_mib": peak_rss_bytes() / 2**20,
          "device_peak_mib": device_peak / 2**20 if device_peak else None, "parameters": _parameters(argv)})
    return code


def _parameters(argv: list[str]) -> int | None:
    """The parameter count the run's summary.json reports, when it wrote one."""
    import json
    from pathlib import Path

    if "--run-dir" not in argv:
        return None
    summary = Path(argv[argv.index("--run-dir") + 1]) / "summary.json"
    return json.loads(summary.read_text()).get("parameters") if summary.is_file() else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
