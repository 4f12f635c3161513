"""Hostile input for every entry point: one clear error, a non-zero exit, and nothing launched.

| entry point                       | called here as                    | "nothing launched" means              |
|-----------------------------------|-----------------------------------|---------------------------------------|
| `python -m job` (the job CLI)     | `job.__main__.main(argv)`         | no `job.initialize`, no `loop.run`    |
| `python -m job.launch`            | `job.launch.main(argv)`           | no `subprocess.Popen`, no ProcessGroup |
| `make submit-slurm`               | `deploy.slurm.submit.main(argv, runner)` | no `sbatch` argv, no submitit executor |
| `make tpu-*`                      | `deploy.tpu.cli.main(argv, runner)`   | no gcloud call at all                  |

Each entry point has a table of known traps (zero, negative, huge, NaN/inf, shell
metacharacters, newlines, look-alike digits) and hypothesis properties over the
space around them. Values that are valid however odd they look (job arguments
with quotes, `$(...)`, `;`) must reach the generated argv as the same words;
that bash then runs none of them is proven in tests/unit/test_security.py.
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import job
from deploy.slurm import submit as slurm
from deploy.slurm.options import GPU_PROBE, OURS
from deploy.slurm.partitions import PARTITION_ARGV
from deploy.tpu import cli as tpu
from deploy.tpu import remote
from job import __main__ as job_cli
from job import launch, task
from job.core import values
from job.errors import ConfigError
from job.tasks.lm import data as lm_data
from job.tasks.lm import model as lm_model
from job.train import config, entry, loop
from tests.doubles import PARTITION, RecordingRunner

ROOT = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


class Launched(AssertionError):
    """Raised by every stand-in for something that starts work: hostile input must never reach one."""


def _boom(*_args: object, **_kwargs: object) -> None:
    raise Launched("hostile input reached a launch")


def outcome(call: Callable[[], int | None]) -> int:
    """The exit status of an entry point, whether it returns it or exits (argparse, tyro)."""
    try:
        return call() or 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def assert_clear(err: str, *needles: str) -> None:
    """One clear error: the needles (the flag, the value) and what was expected; no traceback."""
    assert "Traceback (most recent call last)" not in err, err
    assert "expected" in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err}"


# Characters no name, zone, account or number may hold: each would be a shell, sbatch or gcloud trap.
TRAPS = (" ", ";", "$(id)", "`id`", "|", "&", ">", "'", '"', "\n", "\t", ",", "\\", "*")
# Strings whose every character a real argv can hold (no NUL, no lone surrogate).
ARGV_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24)


def with_trap(word: str = "ok") -> st.SearchStrategy[str]:
    """`word` with one trap character inserted somewhere."""
    return st.tuples(st.integers(0, len(word)), st.sampled_from(TRAPS)).map(
        lambda t: word[:t[0]] + t[1] + word[t[0]:])


# ====================================================================== the job CLI: python -m job
@pytest.fixture
def job_launches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job, "initialize", _boom)
    monkeypatch.setattr(loop, "initialize", _boom)  # the loop's own name for it
    monkeypatch.setattr(jax.distributed, "initialize", _boom)
    monkeypatch.setattr(loop, "run", _boom)


MAX_STEPS = str(config.MAX_STEPS + 1)


@pytest.mark.parametrize(("argv", "needles"), [
    (["--steps=0"], ["--steps", "found 0"]),
    (["--steps=-1"], ["--steps", "found -1"]),
    ([f"--steps={MAX_STEPS}"], ["--steps", MAX_STEPS]),
    (["--steps=99999999999999999999999"], ["--steps"]),
    (["--ckpt.every=0"], ["--ckpt.every"]),
    (["--ckpt.keep=0"], ["--ckpt.keep"]),
    (["--log-every=0"], ["--log-every"]),
    (["--eval-every=-1"], ["--eval-every"]),
    (["--model.dim=0"], ["--model.dim"]),
    (["--model.heads=3"], ["--model.heads", "divisor of --model.dim=64"]),
    (["--model.dim=99999999999"], ["--model.dim"]),  # once a hang: every divisor up to 1e11 was tried
    (["--model.vocab-size=1099511627776"], ["--model.vocab-size"]),
    (["--model.dtype=float64"], ["--model.dtype"]),
    (["--model-axis=0"], ["--model-axis"]),
    (["--rule=evil"], ["--rule: expected one of replicated, fsdp, tensor, fsdp_tensor", "'evil'"]),
    (["--rule="], ["--rule: expected one of replicated, fsdp, tensor, fsdp_tensor"]),
    (["--rule=replicated; rm -rf ~"], ["--rule: expected one of replicated, fsdp, tensor, fsdp_tensor"]),
    (["--rule=tensor", "--model-axis=3"], ["--model.heads"]),
    (["--optim.lr=nan"], ["--optim.lr", "nan"]),
    (["--optim.lr=inf"], ["--optim.lr", "inf"]),
    (["--optim.lr=1e400"], ["--optim.lr", "inf"]),
    (["--optim.lr=-1"], ["--optim.lr"]),
    (["--optim.lr=0"], ["--optim.lr"]),
    (["--optim.warmup-steps=-5"], ["--optim.warmup-steps"]),
    (["--optim.min-lr-ratio=5"], ["--optim.min-lr-ratio"]),
    (["--optim.weight-decay=nan"], ["--optim.weight-decay"]),
    (["--optim.clip-norm=-1"], ["--optim.clip-norm"]),  # 0 is no clipping
    (["--optim.b1=1"], ["--optim.b1"]),
    (["--optim.b2=-0.1"], ["--optim.b2"]),
    (["--watchdog-s=-1"], ["--watchdog-s"]),
    (["--watchdog-s=nan"], ["--watchdog-s"]),
    (["--watchdog-s=inf"], ["--watchdog-s"]),
    (["--straggler-ratio=0.5"], ["--straggler-ratio"]),
    (["--compile-timeout-s=0"], ["--compile-timeout-s", "seconds > 0"]),
    (["--compile-timeout-s=inf"], ["--compile-timeout-s"]),
    (["--straggler-ratio=nan"], ["--straggler-ratio"]),
    (["--seed=-1"], ["--seed"]),
    (["--data.source=/nonexistent/tokens.npy"], ["--data.source", "python -m job tokenize"]),
    (["--run-dir=s3://bucket/run1"], ["--run-dir", "only gs:// URLs"]),
    (["--run-dir=gs://Bucket_With_Capitals/run1"], ["--run-dir", "lowercase"]),
    (["--run-dir=gs://bucket"], ["--run-dir", "not the bucket's root"]),
    ([f"--seed={2**63}"], ["--seed"]),
    (["--run-dir="], ["--run-dir"]),
    (["--run-dir=runs/a\nb"], ["--run-dir"]),
    (["--run-dir=runs/a\x00b"], ["--run-dir"]),
])
def test_job_cli_bad_value_is_one_clear_error_and_exit_2(argv: list[str], needles: list[str],
                                                         job_launches_nothing: None,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert outcome(lambda: job_cli.main(["train", *argv])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Fix:" in err
    assert_clear(err, *needles)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--steps=abc"], "--steps"),
    (["--steps=1e3"], "--steps"),
    (["--steps="], "--steps"),
    (["--steps"], "--steps"),
    (["--no-such-flag=1"], "--no-such-flag"),
    (["--resume=maybe"], "Unrecognized options: maybe"),  # a flag pair: --resume / --no-resume
    (["--ckpt.async-save=2"], "Unrecognized options: 2"),
    (["--data.global-batch=0"], "--data.global-batch"),  # DataConfig's own check, reported by tyro
    (["--data.global-batch=-4"], "--data.global-batch"),
    (["--data.eval-fraction=nan"], "--data.eval-fraction"),
    (["--data.seed=-1"], "--data.seed"),
    (["--data.dtype=float64"], "--data.dtype"),
])
def test_job_cli_unparsable_value_is_a_usage_error(argv: list[str], needle: str, job_launches_nothing: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert outcome(lambda: job_cli.main(["train", *argv])) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback (most recent call last)" not in err, err


@pytest.mark.parametrize(("argv", "says"), [
    (["eval", "--run-dir", "r", "--step", "-1"], "argument --step: expected a whole number >= 0, found '-1'. Fix: "
                                                  "pass one of the run's saved steps"),
    (["export", "--run-dir", "r", "out", "--step", "٣"], "argument --step: expected a whole number >= 0, found '٣'"),
    (["sample", "--run-dir", "r", "--top-k", "0"], "argument --top-k: expected a whole number >= 1, found '0'. Fix: "
                                                   "pass e.g. --top-k 8 (1: greedy)"),
    (["sample", "--run-dir", "r", "--tokens", "1e3"], "argument --tokens: expected a whole number >= 0, found '1e3'"),
    (["sample", "--run-dir", "r", "--seed", "+1"], "argument --seed: expected an integer, found '+1'. Fix: "),
    (["sample", "--run-dir", "r", "--step", "1.5"], "argument --step: expected a whole number >= 0, found '1.5'"),
    (["sweep", "lr=1e-3", "--devices", "0", "--", "train"], "argument --devices: expected a whole number >= 1, "
                                                            "found '0'. Fix: pass the job's total device count"),
])
def test_job_cli_commands_number_flags_are_usage_errors_in_the_same_words(
        argv: list[str], says: str, job_launches_nothing: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert outcome(lambda: job_cli.main(argv)) == 2
    err = capsys.readouterr().err
    assert says in err and "usage:" in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [
    ["demo", "--evil"], ["tokenize", "only-one"], ["tokenize", "a", "b", "c"], [";rm -rf ~"], ["$(id)"], ["trian"],
])
def test_job_cli_unknown_command_or_arguments_is_usage_and_exit_2(argv: list[str], job_launches_nothing: None,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert job_cli.main(argv) == 2
    assert_clear(capsys.readouterr().err, "usage:", repr(" ".join(argv)))


def test_job_cli_tokenize_bad_paths_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "in.txt"
    text.write_text("hello")
    assert job_cli.main(["tokenize", str(tmp_path / "missing.txt"), str(tmp_path / "o.npy")]) == 2
    assert job_cli.main(["tokenize", str(text), str(tmp_path / "o.txt")]) == 2
    err = capsys.readouterr().err
    assert_clear(err, "an existing file", "a path ending in .npy")
    assert list(tmp_path.iterdir()) == [text]


@FAST
@given(steps=st.one_of(st.integers(max_value=0), st.integers(min_value=config.MAX_STEPS + 1)))
def test_job_cli_any_out_of_range_steps_is_refused(steps: int, job_launches_nothing: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert job_cli.main(["train", f"--steps={steps}"]) == 2
    assert_clear(capsys.readouterr().err, "--steps", f"found {steps}")


@FAST
@given(text=ARGV_TEXT)
@example(text="+4")
@example(text="1_000")
@example(text="\u0664")
@example(text=" 4")
def test_job_cli_any_non_integer_text_for_an_integer_flag_is_a_usage_error(text: str, job_launches_nothing: None,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    try:
        values.integer(text)
        assume(False)  # an integer: not this property's business
    except values.BadValue:
        pass  # int() takes some of these ('+4', '1_000', '\u0664', ' 4'): the flag does not
    assert outcome(lambda: job_cli.main(["train", f"--ckpt.every={text}"])) == 2
    assert "--ckpt.every" in capsys.readouterr().err


@FAST
@given(lr=st.one_of(st.floats(max_value=0.0), st.sampled_from([math.nan, math.inf, -math.inf])))
def test_job_cli_any_non_positive_or_non_finite_learning_rate_is_refused(
        lr: float, job_launches_nothing: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert job_cli.main(["train", f"--optim.lr={lr!r}"]) == 2
    assert_clear(capsys.readouterr().err, "--optim.lr", "a finite learning rate > 0")


NUMBER = st.one_of(st.floats(), st.integers(-(2**70), 2**70))
SIZE = st.one_of(st.integers(-4, 300), st.integers(-(2**70), 2**70))


@FAST
@given(steps=SIZE, seed=SIZE, every=SIZE, keep=SIZE, watchdog=NUMBER, lr=NUMBER, warmup=SIZE, ratio=NUMBER,
       decay=NUMBER, clip=NUMBER, b1=NUMBER, b2=NUMBER, dim=SIZE, heads=SIZE, vocab=SIZE, model_axis=SIZE,
       rule=st.sampled_from(["replicated", "fsdp", "tensor", "", "tensor;id"]))
def test_job_config_check_refuses_clearly_or_accepts_only_sane_numbers(
        steps: int, seed: int, every: int, keep: int, watchdog: float, lr: float, warmup: int, ratio: float,
        decay: float, clip: float, b1: float, b2: float, dim: int, heads: int, vocab: int, model_axis: int,
        rule: str) -> None:
    cfg = config.TrainConfig(
        steps=steps, seed=seed, watchdog_s=watchdog, rule=rule, model_axis=model_axis,
        model=lm_model.ModelConfig(dim=dim, heads=heads, vocab_size=vocab), data=lm_data.DataConfig(),
        optim=config.OptimConfig(lr=lr, warmup_steps=warmup, min_lr_ratio=ratio, weight_decay=decay, clip_norm=clip,
                                 b1=b1, b2=b2),
        ckpt=config.CheckpointConfig(every=every, keep=keep),
    )
    try:
        config.validate(cfg, task.load("lm"))
    except ConfigError as exc:  # never a TypeError, ZeroDivisionError, OverflowError or a hang
        assert "expected" in str(exc) and "Fix:" in str(exc)
        return
    assert 1 <= steps <= config.MAX_STEPS and 0 <= seed <= config.MAX_SEED and every >= 1 and keep >= 1
    assert all(math.isfinite(x) for x in (watchdog, lr, ratio, decay, clip, b1, b2))
    assert lr > 0 and clip >= 0 and watchdog >= 0 and decay >= 0 and 0 <= ratio <= 1 and 0 <= b1 < 1 and 0 <= b2 < 1
    assert dim >= 1 and dim % heads == 0 and vocab >= 1 and model_axis >= 1 and rule in ("replicated", "fsdp", "tensor")


def test_job_cli_still_accepts_the_defaults_and_reaches_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[config.TrainConfig] = []
    argvs: list[list[str]] = []
    monkeypatch.setattr(loop, "run", lambda cfg, chosen, argv: ran.append(cfg) or argvs.append(argv) or 0)
    monkeypatch.setattr(entry, "_shutdown", lambda: None)
    assert job_cli.main(["train", "--steps=5", "--optim.lr=1e-3", "--watchdog-s=0"]) == 0
    assert [c.steps for c in ran] == [5]
    assert argvs == [["train", "--steps=5", "--optim.lr=1e-3", "--watchdog-s=0"]]  # recorded for `rerun`


# ====================================================================== the launcher: python -m job.launch
@pytest.fixture
def launcher_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "ProcessGroup", _boom)
    monkeypatch.setattr(subprocess, "Popen", _boom)


CMD = ["--", sys.executable, "-c", "pass"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["-n", "0", *CMD], "expected a whole number >= 1, found '0'"),
    (["-n", "-3", *CMD], "found '-3'"),
    (["-n", "abc", *CMD], "found 'abc'"),
    (["-n", "1.5", *CMD], "found '1.5'"),
    (["-n", "1_0", *CMD], "found '1_0'"),  # int() would read 10
    (["-n", "\u0664", *CMD], "found '\u0664'"),  # an Arabic-Indic 4: int() would read 4
    (["-n", "", *CMD], "found ''"),
    (["-n", "2000", *CMD], f"expected at most {launch.MAX_LOCAL} on one machine, found '2000'"),
    (["-n", "9" * 5000, *CMD], "expected a whole number >= 1"),  # more digits than int() takes
    (["-n", "2", "--devices-per-process", "0", *CMD], "found '0'"),
    (["-n", "2", "--devices-per-process", "x", *CMD], "found 'x'"),
    (["-n", "2", "--devices-per-process", "100000", *CMD], "expected at most"),
    (["-n", "2", "--port", "0", *CMD], "found '0'"),
    (["-n", "2", "--port", "65536", *CMD], "expected a TCP port 1..65535, found '65536'"),
    (["-n", "2", "--port", "80;id", *CMD], "found '80;id'"),
    (["-n", "2", "--kill-after", "-1", *CMD], "expected a number of seconds >= 0, found '-1'"),
    (["-n", "2", "--kill-after", "nan", *CMD], "found 'nan'"),
    (["-n", "2", "--kill-after", "inf", *CMD], "found 'inf'"),
    (["-n", "2", "--kill-after", "5s", *CMD], "found '5s'"),
    (["-n", "2", "--stop-timeout", "-0.5", *CMD], "expected a number of seconds >= 0, found '-0.5'"),
    (["-n", "2", "--stop-timeout", "NaN", *CMD], "found 'NaN'"),
    (["-n", "2", "--stop-timeout", "1e999", *CMD], "found '1e999'"),
    (["-n", "2", "--host", "", *CMD], "expected an IP address or host name"),
    (["-n", "2", "--host", "127.0.0.1; rm -rf ~", *CMD], "found '127.0.0.1; rm -rf ~'"),
    (["-n", "2", "--host", "$(id)", *CMD], "found '$(id)'"),
    (["-n", "2", "--host", "::1", *CMD], "IPv6 in brackets"),  # HOST:PORT would be ambiguous
    (["-n", "2", "--host", "[127.0.0.1]", *CMD], "found '[127.0.0.1]'"),
    (["-n", "2", "--host", "host:80", *CMD], "found 'host:80'"),
    (["-n", "2", "--host", "a..b", *CMD], "found 'a..b'"),
    (["-n", "2", "--port=--", *CMD], "--port: expected a value, found '--'"),  # argparse would drop it
    (["-n", "2", "python3", "-c", "pass"], "expected '--' before the command"),
    (["-n", "2", "--kil-after", "3", *CMD], "expected one of the options above, found '--kil-after'"),
    (["-n", "2", "--"], "expected a command after '--', found none"),
    (["-n", "2"], "expected a command after '--', found none"),
    (["-n", "2", "--", "no-such-program-xyz"], "found 'no-such-program-xyz' (not on PATH)"),
    (["-n", "2", "--", ""], "(not on PATH)"),
    (["-n", "2", "--", "python3; rm -rf ~"], "(not on PATH)"),
])
def test_launcher_bad_input_is_usage_and_exit_2_and_starts_nothing(argv: list[str], needle: str,
                                                                   launcher_starts_nothing: None,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert outcome(lambda: launch.main(argv)) == 2
    err = capsys.readouterr().err
    assert "usage: python -m job.launch" in err
    assert_clear(err, needle)


def test_launcher_without_n_names_the_flag(launcher_starts_nothing: None,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert outcome(lambda: launch.main(CMD)) == 2
    assert "the following arguments are required: -n/--nproc" in capsys.readouterr().err


@FAST
@given(text=ARGV_TEXT)
@example(text="0\x1f")  # once drawn at random: the filter took it for a number, int() did not
@example(text=" 4")
def test_launcher_any_text_but_a_small_whole_number_for_n_is_refused(text: str, launcher_starts_nothing: None,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # what the launcher takes (job.core.values.whole): plain ASCII digits, nothing around them; re's \s would
    # also pass '\x1f', which int() refuses
    assume(not (re.fullmatch(r"[0-9]{1,30}", text) and 1 <= int(text) <= launch.MAX_LOCAL))
    assert outcome(lambda: launch.main([f"--nproc={text}", *CMD])) == 2
    assert_clear(capsys.readouterr().err, "-n/--nproc", repr(text))


@FAST
@given(value=st.floats(), flag=st.sampled_from(["--kill-after", "--stop-timeout"]))
def test_launcher_durations_are_finite_and_not_negative(value: float, flag: str, launcher_starts_nothing: None,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["-n", "2", f"{flag}={value!r}", *CMD]
    if math.isfinite(value) and value >= 0:
        cfg = launch.parse_args(argv)
        assert value in (cfg.kill_after_s, cfg.stop_timeout_s)
    else:
        assert outcome(lambda: launch.main(argv)) == 2
        assert_clear(capsys.readouterr().err, "expected a number of seconds >= 0", repr(value))


@FAST
@given(host=with_trap("node-1.example.com"))
def test_launcher_host_with_any_shell_character_is_refused(host: str, launcher_starts_nothing: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert outcome(lambda: launch.main(["-n", "2", f"--host={host}", *CMD])) == 2
    assert_clear(capsys.readouterr().err, "expected an IP address or host name")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "node-1.example.com", "10.0.0.7", "[::1]"])
def test_launcher_accepts_real_addresses(host: str) -> None:
    assert launch.parse_args(["-n", "2", "--host", host, *CMD]).host == host


# ====================================================================== make submit-slurm: python -m deploy.slurm
def slurm_runner() -> RecordingRunner:
    """A login node with the partitions debug (the default) and gpu, its nodes as tests.doubles answers them."""
    listing = PARTITION + PARTITION.replace("debug", "gpu").replace("Default=YES", "Default=NO")
    return RecordingRunner(available=("sbatch",), responses={PARTITION_ARGV: (0, listing)})


@pytest.fixture
def slurm_submits_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import submitit

    monkeypatch.setattr(submitit, "SlurmExecutor", _boom)


def submitted(runner: RecordingRunner) -> list[list[str]]:
    """The calls that would change something: anything but the read-only scontrol / sinfo / squeue / sacct and
    the probe of the tasks' interpreter for jax's CUDA plugin."""
    return [c for c in runner.calls
            if c[0] not in ("scontrol", "sinfo", "squeue", "sacct") and c[1:] != ["-c", GPU_PROBE]]


@pytest.mark.parametrize(("argv", "needles"), [
    (["--nodes", "0"], ["NODES", "found '0'"]),
    (["--nodes", "-2"], ["NODES", "found '-2'"]),
    (["--nodes", "1_0"], ["NODES", "found '1_0'"]),
    (["--nodes", " 4"], ["NODES", "found ' 4'"]),
    (["--nodes", "4\n"], ["NODES", "found '4\\n'"]),
    (["--nodes", "\u0664"], ["NODES"]),
    (["--nodes", "1e3"], ["NODES", "found '1e3'"]),
    (["--nodes", "4;id"], ["NODES", "found '4;id'"]),
    (["--nodes", "9" * 5000], ["NODES"]),
    (["--gpus-per-node", "-1"], ["GPUS_PER_NODE", "found '-1'"]),
    (["--gpus-per-node", "8 --exclusive"], ["GPUS_PER_NODE"]),
    (["--cpus-per-task", "0"], ["CPUS_PER_TASK", "found '0'"]),
    (["--cpus-per-task", "$(nproc)"], ["CPUS_PER_TASK"]),
    (["--time", "1h"], ["TIME", "found '1h'"]),
    (["--time", "-5"], ["TIME"]),
    (["--time", "0"], ["TIME", "a positive duration"]),
    (["--time", "01:00:00\n#SBATCH --qos=high"], ["TIME"]),
    (["--time", "01:00:00\n"], ["TIME"]),
    (["--time", " 01:00:00"], ["TIME"]),
    (["--time", "01:00:00; rm -rf ~"], ["TIME"]),
    (["--partition", "big"], ["PARTITION", "one of debug, gpu", "found 'big'"]),
    (["--partition", "debug;id"], ["PARTITION"]),
    (["--partition", "debug\n#SBATCH --qos=high"], ["PARTITION"]),
    (["--account", "proj\ntouch /tmp/pwned"], ["ACCOUNT"]),  # submitit writes it into an #SBATCH line
    (["--account", "a b"], ["ACCOUNT", "found 'a b'"]),
    (["--account", "a,b"], ["ACCOUNT"]),
    (["--account", "$(id)"], ["ACCOUNT"]),
    (["--qos", "normal'; id; '"], ["QOS"]),
    (["--qos", "high\n#SBATCH --nodes=999"], ["QOS"]),
    (["--image", "img,LD_PRELOAD=/tmp/x.so"], ["IMAGE"]),  # --export=ALL,IMAGE=...: a second variable
    (["--image", "a b"], ["IMAGE"]),
    (["--image", "img\n"], ["IMAGE"]),
    (["--image=--privileged", "--container-runtime=podman"], ["IMAGE", "leading '-'"]),  # a podman option
    (["--via", "ssh"], ["VIA", "found 'ssh'"]),
    (["--via", "sbatch;id"], ["VIA"]),
    (["--log-dir", "logs,LD_PRELOAD=/tmp/x.so"], ["--log-dir"]),
    (["--log-dir", "logs\n#SBATCH --qos=high"], ["--log-dir"]),
    (["--", "train", "--name", "a\x00b"], ["ARGS", "NUL"]),
    (["--tasks-per-node", "0"], ["TASKS_PER_NODE", "found '0'"]),
    (["--tasks-per-node", "2;id"], ["TASKS_PER_NODE", "found '2;id'"]),
    (["--tasks-per-node", "\u0664"], ["TASKS_PER_NODE"]),
    (["--gpus-per-node", "4", "--tasks-per-node", "3"], ["TASKS_PER_NODE", "a divisor of GPUS_PER_NODE=4"]),
    (["--gpus-per-node", "4", "--tasks-per-node", "8"], ["TASKS_PER_NODE", "found 8"]),
    (["--gpu-type", "a100"], ["GPU_TYPE", "GPUS_PER_NODE > 0"]),
    (["--gpus-per-node", "4", "--gpu-type", "a100:8"], ["GPU_TYPE", "found 'a100:8'"]),  # would ask a100:8:4
    (["--gpus-per-node", "4", "--gpu-type", "a100,gpu:h100"], ["GPU_TYPE"]),
    (["--gpus-per-node", "4", "--gpu-type", "a100\n#SBATCH --qos=high"], ["GPU_TYPE"]),
    (["--gpus-per-node", "4", "--gpu-type", "$(id)"], ["GPU_TYPE"]),
    (["--gres=1"], ["GRES", "GPUS_PER_NODE > 0"]),
    (["--gpus-per-node", "4", "--gres=maybe"], ["GRES", "expected 1 or 0", "found 'maybe'"]),
    (["--wait=maybe"], ["WAIT", "expected 1 or 0", "found 'maybe'"]),
    (["--exclusive=2"], ["EXCLUSIVE", "found '2'"]),
    (["--exclusive=1;id"], ["EXCLUSIVE"]),
    (["--exclusive= 1"], ["EXCLUSIVE"]),
    (["--dry-run=please"], ["DRY_RUN", "found 'please'"]),
    (["--mem", "64GB"], ["MEM", "found '64GB'", "64G"]),
    (["--mem", "-1"], ["MEM"]),
    (["--mem", "lots"], ["MEM", "found 'lots'"]),
    (["--mem", "64 G"], ["MEM"]),
    (["--mem", "64G\n#SBATCH --qos=high"], ["MEM"]),  # submitit writes it into an #SBATCH line
    (["--mem", "\u0664G"], ["MEM"]),
    (["--constraint", "a100 && id"], ["CONSTRAINT"]),
    (["--constraint", "a100\n#SBATCH --qos=high"], ["CONSTRAINT"]),
    (["--constraint", "$(id)"], ["CONSTRAINT"]),
    (["--constraint", "a100,LD_PRELOAD=x"], ["CONSTRAINT"]),
    (["--constraint", "a100'"], ["CONSTRAINT"]),
    (["--container-runtime", "docker", "--image", "img"], ["CONTAINER_RUNTIME", "found 'docker'"]),
    (["--container-runtime", "podman;id", "--image", "img"], ["CONTAINER_RUNTIME"]),
    (["--container-runtime", "podman"], ["CONTAINER_RUNTIME", "IMAGE"]),
    (["--python", "/venv/bin/python,LD_PRELOAD=/tmp/x.so"], ["PYTHON"]),  # --export=ALL,JOB_PYTHON=...
    (["--python", "/venv/bin/python\n"], ["PYTHON"]),
    (["--python", "python -c id"], ["PYTHON"]),
    (["--sbatch-args=--nodes=99"], ["SBATCH_ARGS", "found '--nodes=99'", "NODES"]),
    (["--sbatch-args=--ntasks-per-node=99"], ["SBATCH_ARGS", "TASKS_PER_NODE"]),
    (["--sbatch-args=--begin=now --gpus=8"], ["SBATCH_ARGS", "found '--gpus=8'", "GPUS_PER_NODE"]),
    (["--sbatch-args=--time=9-00"], ["SBATCH_ARGS", "TIME"]),
    (["--sbatch-args=--export=ALL,LD_PRELOAD=/tmp/x.so"], ["SBATCH_ARGS", "--export"]),
    (["--sbatch-args=--exp=NONE"], ["SBATCH_ARGS", "--export"]),  # sbatch takes unique abbreviations
    (["--sbatch-args=--export-file=/tmp/env"], ["SBATCH_ARGS", "--export-file"]),
    (["--sbatch-args=--output=/etc/cron.d/x"], ["SBATCH_ARGS", "--log-dir"]),
    (["--sbatch-args=--wrap='touch /tmp/pwned'"], ["SBATCH_ARGS", "ARGS"]),
    (["--sbatch-args=--no-requeue"], ["SBATCH_ARGS", "--no-requeue"]),
    (["--sbatch-args=-N 99"], ["SBATCH_ARGS", "found '-N'", "long form"]),
    (["--sbatch-args=; touch /tmp/pwned"], ["SBATCH_ARGS", "found ';'"]),
    (["--sbatch-args=$(id)"], ["SBATCH_ARGS", "found '$(id)'"]),
    (["--sbatch-args=--comment='a\n#SBATCH --qos=high'"], ["SBATCH_ARGS", "control characters"]),
    (["--sbatch-args=--comment=a\\\\nb"], ["SBATCH_ARGS", "backslashes"]),  # sbatch's #SBATCH reader eats them
    (["--sbatch-args=--begin="], ["SBATCH_ARGS"]),
    (["--sbatch-args=--Nodes=9"], ["SBATCH_ARGS"]),
])
def test_submit_slurm_bad_value_is_one_clear_error_and_submits_nothing(
        argv: list[str], needles: list[str], slurm_submits_nothing: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    runner = slurm_runner()
    assert slurm.main(["--nodes", "2", *argv], runner=runner) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Fix:" in err
    assert_clear(err, *needles)
    assert submitted(runner) == []


def test_submit_slurm_unwritable_log_dir_is_a_clear_error(tmp_path: Path, slurm_submits_nothing: None,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for via in ("submitit", "sbatch"):
        runner = slurm_runner()
        assert slurm.main(["--via", via, "--log-dir", str(blocker / "logs")], runner=runner) == 2
        assert_clear(capsys.readouterr().err, "--log-dir", "a folder this user can create and write")
        assert submitted(runner) == []


@pytest.mark.parametrize(("argv", "needle"), [
    (["--nodez", "4"], "unrecognized arguments: --nodez"),
    (["--nodes"], "expected one argument"),
    (["train"], "unrecognized arguments: train"),
    # argparse itself drops an `--opt=--` value (the default would apply): refused before parsing
    (["--time", "--"], "expected one argument"),
    (["--time=--"], "--time: expected a value, found '--'"),
    (["--partition=--"], "--partition: expected a value, found '--'"),
    (["--args=--"], "--args: expected a value, found '--'"),
    (["--mem=--"], "--mem: expected a value, found '--'"),
    (["--tasks-per-node=--"], "--tasks-per-node: expected a value, found '--'"),
    (["--gres=--"], "--gres: expected a value, found '--'"),
    (["--sbatch-args=--"], "--sbatch-args: expected a value, found '--'"),
    (["--sbatch-args=--comment='open"], "quotes balanced"),
])
def test_submit_slurm_unknown_flags_and_missing_values_are_usage_errors(
        argv: list[str], needle: str, slurm_submits_nothing: None, capsys: pytest.CaptureFixture[str]) -> None:
    runner = slurm_runner()
    assert outcome(lambda: slurm.main(argv, runner=runner)) == 2
    err = capsys.readouterr().err
    assert "usage: python -m deploy.slurm" in err and needle in err, err
    assert runner.calls == []


@FAST
@given(nodes=st.one_of(ARGV_TEXT, st.integers(max_value=0).map(str)))
def test_submit_slurm_any_nodes_but_a_plain_whole_number_is_refused(nodes: str, slurm_submits_nothing: None,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assume(not (re.fullmatch(r"[0-9]+", nodes) and int(nodes) >= 1))
    runner = slurm_runner()
    assert slurm.main([f"--nodes={nodes}"], runner=runner) == 2
    assert_clear(capsys.readouterr().err, "NODES: expected a whole number >= 1", repr(nodes))
    assert runner.calls == []


@FAST
@given(flag=st.sampled_from(["--account", "--qos"]), value=with_trap("proj-1"))
def test_submit_slurm_account_and_qos_with_any_trap_are_refused(flag: str, value: str, slurm_submits_nothing: None,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    runner = slurm_runner()
    assert slurm.main([f"{flag}={value}"], runner=runner) == 2
    assert_clear(capsys.readouterr().err, flag[2:].upper(), repr(value))
    assert submitted(runner) == []


@FAST
@given(time=ARGV_TEXT)
@example(time="--")  # argparse alone would drop this value and submit with the default time
def test_submit_slurm_time_is_a_slurm_duration_or_refused(time: str, slurm_submits_nothing: None,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assume(time)  # "" means the default
    runner = slurm_runner()
    try:
        slurm.time_minutes(time)
    except ConfigError:
        assert outcome(lambda: slurm.main([f"--time={time}"], runner=runner)) == 2
        err = capsys.readouterr().err
        assert_clear(err)
        assert "TIME" in err or "--time" in err, err
        assert submitted(runner) == []
        return
    assert re.fullmatch(r"[0-9:-]+", time), time  # accepted: digits and separators only


# Job arguments are the user's to choose: odd ones are passed on, never interpreted.
HOSTILE_ARGS = ("train", "--run-dir", "runs/a b", "--name", "x; touch /tmp/pwned", "$(id)", "`id`", "it's \"q\"",
                "a\nb", "*", "--", "-n", "ARGS=1,2")


def sbatch_call(runner: RecordingRunner) -> list[str]:
    calls = [c for c in runner.calls if c[0] == "sbatch"]
    assert len(calls) == 1, runner.calls
    return calls[0]


def test_submit_slurm_odd_job_arguments_reach_sbatch_as_the_same_words(tmp_path: Path) -> None:
    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (0, "42\n")})
    assert slurm.main(["--nodes", "2", "--via", "sbatch", "--log-dir", str(tmp_path), "--", *HOSTILE_ARGS],
                      runner=runner) == 0
    argv = sbatch_call(runner)
    script = argv.index(str(slurm.SBATCH_SCRIPT))
    assert argv[script + 1:] == list(HOSTILE_ARGS)  # after the script: its "$@", word for word
    assert all(a.startswith("--") for a in argv[1:script])  # before it: only our own sbatch options


@FAST
@given(words=st.lists(ARGV_TEXT, min_size=1, max_size=6))
def test_submit_slurm_any_job_arguments_reach_sbatch_and_submitit_verbatim(
        words: list[str], tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    if words[0].startswith("-"):  # no command first: refused before anything is queued (tests/unit/test_first_hour.py)
        words = ["train", *words]
    log_dir = str(tmp_path_factory.mktemp("logs"))
    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (0, "42\n")})
    assert slurm.main(["--via", "sbatch", "--log-dir", log_dir, "--", *words], runner=runner) == 0
    assert sbatch_call(runner)[-len(words):] == words

    handed: list[list[str]] = []

    class Executor:  # submitit's: pickles the task and its argument list, no shell
        def __init__(self, folder: str, **_options: object) -> None:
            pass

        def update_parameters(self, **_params: object) -> None:
            pass

        def submit(self, _task: object, args: list[str]) -> object:
            handed.append(args)
            raise Launched("stop here: the arguments are what this test checks")

    import submitit

    monkeypatch.setattr(submitit, "SlurmExecutor", Executor)
    with pytest.raises(Launched):
        slurm.main(["--via", "submitit", "--log-dir", log_dir, "--", *words], runner=slurm_runner())
    assert handed == [words]


@FAST
@given(words=st.lists(ARGV_TEXT, min_size=1, max_size=4))
@example(words=["--comment=a b #1", "--mail-type=END,FAIL"])
@example(words=["--ntasks-per-n=2"])
def test_submit_slurm_sbatch_args_are_long_options_we_do_not_set_or_refused(
        words: list[str], tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = str(tmp_path_factory.mktemp("logs"))
    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (0, "42\n")})
    code = outcome(lambda: slurm.main(["--via=sbatch", f"--log-dir={log_dir}", f"--sbatch-args={shlex.join(words)}"],
                                      runner=runner))
    err = capsys.readouterr().err
    if code != 0:
        assert code == 2 and ("SBATCH_ARGS" in err or "--sbatch-args" in err), err
        assert_clear(err)
        assert submitted(runner) == []
        return
    argv = sbatch_call(runner)
    export = next(i for i, a in enumerate(argv) if a.startswith("--export="))
    assert argv[export - len(words):export] == words  # verbatim, each one argv word, before the script
    for word in words:
        name, _, value = word[2:].partition("=")
        assert word.startswith("--") and re.fullmatch(r"[a-z][a-z0-9-]*", name), word
        assert value.isprintable() and "\\" not in value, word
        assert not any(ours.startswith(name) for ours in OURS), word


# ====================================================================== make tpu-*: python -m deploy.tpu
TPU_OK = ["--name=pod-1", "--zone=us-central2-b", "--accelerator=v4-8", f"--source-dir={ROOT}",
          "--args=train --run-dir /mnt/bucket/run1"]
MUTATING = ("create", "delete", "ssh", "scp")


def gcloud_runner() -> RecordingRunner:
    return RecordingRunner(available=("gcloud",),
                           responses={("gcloud", "compute", "tpus", "tpu-vm", "describe"): (0, "READY\tv4-8\n")})


def tpu_main(command: str, *flags: str, runner: RecordingRunner) -> int:
    """deploy.tpu.cli with TPU_OK's values, each overridden by a flag of the same name in `flags`."""
    names = {f.split("=", 1)[0] for f in flags}
    return outcome(lambda: tpu.main([command, *[f for f in TPU_OK if f.split("=", 1)[0] not in names], *flags],
                                    runner=runner))


@pytest.mark.parametrize(("flags", "needle"), [
    (["--name=My-Pod"], "TPU_NAME"),
    (["--name=pod_1"], "TPU_NAME"),
    (["--name=pod 1"], "TPU_NAME"),
    (["--name=pod;rm -rf ~"], "TPU_NAME"),
    (["--name=pod-1\n"], "TPU_NAME"),  # `$` in a regex also matches before a final newline
    (["--name="], "TPU_NAME"),
    (["--name=" + "p" * 64], "TPU_NAME"),
    (["--name=-pod"], "TPU_NAME"),
    (["--name=pod-"], "TPU_NAME"),
    (["--name=$(id)"], "TPU_NAME"),
    (["--zone="], "ZONE"),
    (["--zone=us-central2"], "ZONE"),
    (["--zone=US-CENTRAL2-B"], "ZONE"),
    (["--zone=us-central2-b\n"], "ZONE"),
    (["--zone=us-central2-b;id"], "ZONE"),
    (["--accelerator=v4-7"], "ACCELERATOR"),
    (["--accelerator=v99-8"], "a known TPU generation"),
    (["--accelerator="], "ACCELERATOR"),
    (["--accelerator=v4-8\n"], "ACCELERATOR"),
    (["--accelerator=v4-8;id"], "ACCELERATOR"),
    (["--accelerator=v4-0"], "ACCELERATOR"),
    (["--accelerator=v4--8"], "ACCELERATOR"),
    (["--accelerator=v4-99999999999999999999999"], "ACCELERATOR"),
    (["--retries=-1"], "expected a whole number >= 0, found '-1'"),
    (["--retries=abc"], "found 'abc'"),
    (["--retries=1.5"], "found '1.5'"),
    (["--spot=maybe"], "expected 1 or 0 (or true/false), found 'maybe'"),
    (["--spot=2"], "found '2'"),
    (["--spot=yes; rm -rf ~"], "expected 1 or 0"),
    (["--queued=x"], "expected 1 or 0"),
    (["--dry-run=please"], "expected 1 or 0"),
    (["--args=train 'unclosed"], "quotes balanced"),
    (['--args=train "a'], "quotes balanced"),
    (["--runtime=base $(id)"], "RUNTIME"),
    (["--runtime=base\n"], "RUNTIME"),
    (["--project=P"], "PROJECT"),
    (["--project=my-proj\n"], "PROJECT"),
    (["--image=a b"], "IMAGE"),
    (["--image=img;id"], "IMAGE"),
    (["--image=img\n"], "IMAGE"),
    (["--image=$(id)"], "IMAGE"),
    (["--remote-dir=../x"], "--remote-dir"),
    (["--remote-dir=a/b"], "--remote-dir"),
    (["--remote-dir=.hidden"], "--remote-dir"),
    (["--remote-dir=x\n"], "--remote-dir"),
    (["--poll-seconds=0"], "expected a number of seconds > 0, found '0'"),
    (["--poll-seconds=-1"], "found '-1'"),
    (["--poll-seconds=nan"], "found 'nan'"),
    (["--poll-seconds=inf"], "found 'inf'"),
    (["--ready-timeout=0"], "expected a number of seconds > 0"),
    (["--ready-timeout=1e999"], "found '1e999'"),
    (["--stop-grace=-1"], "expected a whole number >= 0"),
    (["--ship", "/etc"], "--ship"),  # each shipped path is also `rm -rf`'d on the workers
    (["--ship", "../.ssh"], "--ship"),
    (["--ship", "job/../../x"], "--ship"),
    (["--ship", ""], "--ship"),
    (["--ship", "."], "--ship"),  # the checkout itself: `rm -rf -- .` on the workers
    (["--ship", "./"], "--ship"),
    (["--ship", "no-such-path"], "--ship"),
    (["--accelerator=v4-32", "--args=train"], "--run-dir"),  # 4 workers: checkpoints must be shared
    (["--accelerator=v4-32", "--args=train --run-dir runs/local"], "--run-dir"),
    (["--", "train"], "either --args '...' or words after `--`"),
    (["--zone=--"], "--zone: expected a value, found '--'"),  # argparse would drop it
])
def test_tpu_pod_bad_value_is_one_clear_error_and_calls_no_gcloud(flags: list[str], needle: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    runner = gcloud_runner()
    assert tpu_main("pod", *flags, runner=runner) == 2
    assert_clear(capsys.readouterr().err, needle)
    assert runner.calls == []


@pytest.mark.parametrize("command", tpu.COMMANDS)
def test_every_tpu_command_refuses_a_hostile_name_before_gcloud(command: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    runner = gcloud_runner()
    assert tpu_main(command, "--name=pod-1; gcloud projects delete x", runner=runner) == 2
    assert_clear(capsys.readouterr().err, "TPU_NAME (--name)", "Fix:")
    assert runner.calls == []


@pytest.mark.parametrize("argv", [["frobnicate"], ["pod;id"], ["--name=pod-1"], []])
def test_tpu_unknown_command_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    runner = gcloud_runner()
    assert outcome(lambda: tpu.main(argv, runner=runner)) == 2
    assert "usage: python -m deploy.tpu" in capsys.readouterr().err
    assert runner.calls == []


# A good value of each name-like flag; image references and runtime versions may hold ',' and '*',
# which are harmless there (every use quotes them), so only the shell's own characters are traps for all.
TPU_WORDS = [("--name", "pod-1"), ("--zone", "us-central2-b"), ("--accelerator", "v4-8"), ("--project", "my-project"),
             ("--image", "us-docker.pkg.dev/p/r/job:tpu"), ("--runtime", "tpu-ubuntu2204-base"),
             ("--remote-dir", "jax-job")]
SHELL_TRAPS = tuple(t for t in TRAPS if t not in (",", "*"))


@FAST
@given(flag_value=st.sampled_from(TPU_WORDS), where=st.floats(0, 1), trap=st.sampled_from(SHELL_TRAPS))
def test_tpu_any_shell_character_in_a_name_like_value_is_refused_before_gcloud(
        flag_value: tuple[str, str], where: float, trap: str, capsys: pytest.CaptureFixture[str]) -> None:
    flag, good = flag_value
    cut = round(where * len(good))
    value = good[:cut] + trap + good[cut:]
    runner = gcloud_runner()
    assert tpu_main("pod", f"{flag}={value}", runner=runner) == 2
    assert_clear(capsys.readouterr().err, "Fix:")
    assert runner.calls == []


@FAST
@given(name=ARGV_TEXT)
def test_tpu_name_is_a_gce_name_or_refused_before_gcloud(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    runner = gcloud_runner()
    code = tpu_main("status", f"--name={name}", runner=runner)
    if re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name):
        assert code == 0 and runner.calls[0][5] == name  # the node name: one argv word
        return
    assert code == 2 and runner.calls == []
    assert_clear(capsys.readouterr().err, "TPU_NAME (--name)")


@FAST
@given(text=ARGV_TEXT, flag=st.sampled_from(["--retries", "--stop-grace"]))
def test_tpu_counts_are_plain_whole_numbers_or_refused(text: str, flag: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assume(not re.fullmatch(r"[0-9]{1,30}", text))  # what the flag takes (plain ASCII digits): not this property's
    runner = gcloud_runner()
    assert tpu_main("pod", f"{flag}={text}", runner=runner) == 2
    assert_clear(capsys.readouterr().err, "expected a whole number >= 0")
    assert runner.calls == []


@FAST
@given(words=st.lists(ARGV_TEXT, max_size=6))
def test_tpu_any_job_arguments_reach_the_workers_script_verbatim(words: list[str],
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    assume(not any(w.startswith(("--run-dir", "--run_dir")) for w in words))  # another run dir: its own tests
    local = tmp_path_factory.mktemp("tpu")
    runner = gcloud_runner()
    args = shlex.join(["train", "--run-dir", "/mnt/b/r", *words])
    assert tpu_main("run", f"--args={args}", "--image=us-docker.pkg.dev/p/r/job:tpu", f"--local-dir={local}",
                    runner=runner) == 0
    _, cfg = tpu.parse_args(["run", *TPU_OK[:4], f"--args={args}", "--image=us-docker.pkg.dev/p/r/job:tpu",
                             f"--local-dir={local}"])
    assert cfg.job_args == ("train", "--run-dir", "/mnt/b/r", *words)
    ssh = [c for c in runner.calls if c[4] == "ssh"]
    run = [c for c in ssh if f"--command={remote.start_script(cfg)}" in c]
    assert len(run) == 1 and sum(a.startswith("--command=") for a in run[0]) == 1
    assert remote.job_command(cfg).endswith(" ".join(shlex.quote(w) for w in cfg.job_args))


@pytest.mark.parametrize(("argv", "needle"), [
    (["-n", "5000"], "expected at most 1024"),
    (["-n", "0"], "expected a whole number >= 1"),
    (["--kill-after", "nan"], "expected a number of seconds >= 0"),
    (["--kill-after", "-1"], "expected a number of seconds >= 0"),
])
def test_container_launcher_refuses_what_the_job_launcher_refuses(argv: list[str], needle: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.test_security import _load_run_local

    run_local = _load_run_local()
    full = ["-n", "2", "--image", "jax-cluster-job:cpu", *argv, "--", "train"]
    assert outcome(lambda: run_local.parse_args(full)) == 2
    assert_clear(capsys.readouterr().err, needle)
