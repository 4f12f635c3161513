"""Where a checkpoint's time goes on a chip: the disk, orbax's options, the restore.

    python -m bench.ckpt_options OUT_DIR [--small]      # on a TPU VM; --small: a CPU-sized dry run

One process. The disk's own rates (dd: synced write, O_DIRECT write and read, page-cache read); a one-number state
saved by the template's Checkpointer and by orbax with the template's handler, synced, unsynced and without OCDBT,
with orbax's log traced (OUT_DIR/orbax-trace.log, for where the fixed cost goes); a 1.9 GB state shaped like
gpt2-small's train state (f32 parameters and two moments, 375 arrays) written whole by each option (OCDBT off,
file sync off, bounded and pinned device-to-host copies, 256 MB data files, zarr3) against numpy (synced and not);
restore warm and cold (files evicted with posix_fadvise) against np.load + device_put. The steps beside a save
are bench.ckpt_beside's, which saves fresh arrays each time. Figures go to OUT_DIR/probe.json and the console
(bench/RESULTS-tpu.md section 6).
Arrays read to the host once keep a host copy in jax: the whole-write figures of the orbax options after the
first therefore leave the device-to-host copy out (bench.ckpt_beside saves fresh arrays).
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench-ckpt-out")
OUT.mkdir(parents=True, exist_ok=True)
ROOT = OUT / "folders"
shutil.rmtree(ROOT, ignore_errors=True)
ROOT.mkdir(parents=True)
results: dict = {}


def say(*a):
    print(*a, flush=True)


def run(*argv: str) -> str:
    """A command's output (argv, no shell), stdout and stderr together; its last line for dd's rate."""
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    return (done.stdout + done.stderr).strip()


def last(text: str) -> str:
    return text.splitlines()[-1] if text else ""


def save_results():
    (OUT / "probe.json").write_text(json.dumps(results, indent=1, default=str))


# ---- 0. the machine and the disk
results["df"] = "\n".join([run("df", "-hT", str(ROOT), "/tmp"), run("findmnt", "-T", str(ROOT)), run("nproc"),
                            run("free", "-g")])
say(results["df"])
dd = ROOT / "dd"
DDN = 8 if "--small" in sys.argv else 64
results["dd_write_fsync"] = last(run("dd", "if=/dev/zero", f"of={dd}", "bs=16M", f"count={DDN}", "conv=fsync"))
results["dd_read_warm"] = last(run("dd", f"if={dd}", "of=/dev/null", "bs=16M"))
results["dd_read_direct"] = last(run("dd", f"if={dd}", "of=/dev/null", "bs=16M", "iflag=direct"))
results["dd_write_direct"] = last(run("dd", "if=/dev/zero", f"of={dd}2", "bs=16M", f"count={DDN}", "oflag=direct",
                                      "conv=fsync"))
Path(f"{dd}2").unlink(missing_ok=True)
results["dd_write_nosync"] = last(run("dd", "if=/dev/zero", f"of={dd}2", "bs=16M", f"count={DDN}"))
os.sync()
dd.unlink(missing_ok=True)
Path(f"{dd}2").unlink(missing_ok=True)
for k in ("dd_write_fsync", "dd_read_warm", "dd_read_direct", "dd_write_direct", "dd_write_nosync"):
    say(k, results[k])
save_results()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from bench.ckpt import dropped_from_cache, write_numpy  # noqa: E402
from bench.ckpt_chip import handler, manager, train_state  # noqa: E402
from job.core import internals  # noqa: E402
from job.runs.checkpoint import Checkpointer, abstract  # noqa: E402
from job.runs.config import CheckpointConfig  # noqa: E402

results["versions"] = {"jax": jax.__version__, "orbax": ocp.__version__, "device": str(jax.devices()[0].device_kind)}
say(results["versions"])

events: dict[str, float] = {}
listening = {"on": False}


def record(event, seconds, **_):
    if listening["on"]:
        events[event] = events.get(event, 0.0) + seconds


jax.monitoring.register_event_duration_secs_listener(record)

# ---- the state: gpt2-small's train state's shapes (param, mu, nu), f32, about 1.9 GB in about 300 arrays
SMALL = bool("--small" in sys.argv)
state = train_state(SMALL)
leaves = jax.tree.leaves(state)
nbytes = sum(x.nbytes for x in leaves)
results["state"] = {"arrays": len(leaves), "bytes": nbytes}
say("state", len(leaves), nbytes / 2**20, "MiB")
tiny = {"x": jnp.zeros((), jnp.float32)}


def set_sync(on: bool):
    for ctx in internals.orbax_ts_contexts():
        if on:
            ctx.pop("file_io_sync", None)
        else:
            ctx["file_io_sync"] = False


def du(path):
    files = [f for f in Path(path).rglob("*") if f.is_file()]
    return f"{sum(f.stat().st_size for f in files)} bytes in {len(files)} files"


def orbax_variant(name, kw=None, sync=True, file_size=None, item=None, saves=3):
    """Whole write (save + wait) of `saves` saves into a fresh manager; orbax's events of the last."""
    item = state if item is None else item
    set_sync(sync)
    path = ROOT / name
    out = {"block": [], "whole": []}
    m = None
    try:
        m = manager(path, **(kw or {}))
        for step in range(1, saves + 1):
            events.clear()
            listening["on"] = True
            t = time.perf_counter()
            args = ocp.args.PyTreeSave(item, ocdbt_target_data_file_size=file_size) if file_size else ocp.args.PyTreeSave(item)
            m.save(step, args=args, force=True)
            out["block"].append(time.perf_counter() - t)
            m.wait_until_finished()
            out["whole"].append(time.perf_counter() - t)
            listening["on"] = False
        out["events"] = dict(sorted(events.items()))
        out["du"] = du(path / str(saves))
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        listening["on"] = False
    finally:
        try:
            if m is not None:
                m.close()
        except Exception:  # noqa: BLE001
            pass
        set_sync(True)
    results.setdefault("orbax", {})[name] = out
    say(name, {k: [round(x, 3) for x in v] if isinstance(v, list) else v for k, v in out.items() if k != "events"})
    save_results()
    return path


def template_variant(name, item, saves=3, **cfg):
    path = ROOT / name
    c = Checkpointer(path, CheckpointConfig(every=1, keep=1, **cfg), training=True)
    out = {"block": [], "whole": []}
    for step in range(1, saves + 1):
        events.clear()
        listening["on"] = True
        t = time.perf_counter()
        c.save(step, item)
        out["block"].append(time.perf_counter() - t)
        c.wait()
        out["whole"].append(time.perf_counter() - t)
        listening["on"] = False
    out["events"] = dict(sorted(events.items()))
    results.setdefault("template", {})[name] = out
    say(name, {k: [round(x, 3) for x in v] for k, v in out.items() if k != "events"})
    save_results()
    return c, path


def numpy_write(name, sync):
    path = ROOT / name
    shutil.rmtree(path, ignore_errors=True)
    t = time.perf_counter()
    write_numpy(path, leaves, sync=sync)
    return time.perf_counter() - t


# ---- 1. fixed cost: a one-number state, with a trace of orbax's log
trace = logging.FileHandler(OUT / "orbax-trace.log")
trace.setFormatter(logging.Formatter("%(relativeCreated)10.1f %(threadName)s %(name)s %(message)s"))
trace.setLevel(logging.DEBUG)
absl = logging.getLogger("absl")
absl.addHandler(trace)
absl.setLevel(logging.DEBUG)
try:
    from absl import logging as absl_logging
    absl_logging.set_verbosity(1)
except Exception:  # noqa: BLE001
    pass
logging.getLogger("job").addHandler(trace)
logging.getLogger("job").setLevel(logging.DEBUG)
absl.info("=== template, one number, 3 saves")
template_variant("tiny-template", tiny, saves=2)
absl.info("=== orbax (our handler), one number")
orbax_variant("tiny-orbax", item=tiny, saves=2)
absl.info("=== orbax, one number, no file sync")
orbax_variant("tiny-orbax-nosync", item=tiny, sync=False, saves=2)
absl.info("=== orbax, one number, no ocdbt")
orbax_variant("tiny-orbax-noocdbt", {"use_ocdbt": False}, item=tiny, saves=2)
absl.info("=== template, the state")
template_variant("state-template", state, saves=2)
absl.removeHandler(trace)
absl.setLevel(logging.WARNING)
logging.getLogger("job").removeHandler(trace)
try:
    from absl import logging as absl_logging
    absl_logging.set_verbosity(0)
except Exception:  # noqa: BLE001
    pass

# ---- 2. the whole write of the state, by option
nump = {"nosync": [], "sync": []}
for _ in range(2):
    nump["sync"].append(numpy_write("np-sync", True))
    nump["nosync"].append(numpy_write("np-nosync", False))
results["numpy"] = nump
say("numpy", nump)
save_results()
budget_end = time.monotonic() + 240.0
for name, kw, sync, fsize in [
    ("orbax", {}, True, None),
    ("orbax-nosync", {}, False, None),
    ("orbax-noocdbt", {"use_ocdbt": False}, True, None),
    ("orbax-d2h-256M", {"save_device_host_concurrent_gb": 0.25}, True, None),
    ("orbax-pinned", {"enable_pinned_host_transfer": True}, True, None),
    ("orbax-files-256M", {}, True, 256 * 2**20),
    ("orbax-zarr3", {"use_zarr3": True}, True, None),
]:
    if time.monotonic() > budget_end:
        say("skipped", name)
        continue
    orbax_variant(name, kw, sync, fsize, saves=2)

# ---- 3. restore, warm and cold (steps beside a save of fresh arrays: bench.ckpt_beside)
like = abstract(state)
flat_like = jax.tree.leaves(like)


def orbax_restore(path, step, cold):
    if cold:
        dropped_from_cache(path)
    m = ocp.CheckpointManager(path, item_handlers=handler())
    t = time.perf_counter()
    got = m.restore(step, args=ocp.args.PyTreeRestore(item=like, restore_args=ocp.checkpoint_utils.construct_restore_args(like)))
    jax.block_until_ready(got)
    s = time.perf_counter() - t
    m.close()
    return s


def numpy_restore(cold):
    path = ROOT / "np-sync"
    if cold:
        dropped_from_cache(path)
    t = time.perf_counter()
    arrays = [jax.device_put(np.load(path / f"{i}.npy"), x.sharding) for i, x in enumerate(flat_like)]
    jax.block_until_ready(arrays)
    return time.perf_counter() - t


rest = {}
opath = ROOT / "orbax"
ostep = max(int(p.name) for p in opath.iterdir() if p.name.isdigit()) if opath.exists() else None
for cold in (False, True, False, True):
    key = "cold" if cold else "warm"
    if ostep is not None:
        rest.setdefault(f"orbax {key}", []).append(orbax_restore(opath, ostep, cold))
    rest.setdefault(f"numpy {key}", []).append(numpy_restore(cold))
    say(rest)
results["restore"] = rest
save_results()
say("done")
