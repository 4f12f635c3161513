"""One parser per kind of value (job/core/values.py): the launcher, the Slurm make variables and the TPU
make variables take the same words and refuse the same ones, with the same expected / found words."""

from __future__ import annotations

import argparse

import pytest

from deploy.slurm import options as slurm_options
from deploy.tpu import cli as tpu_cli
from job import launch
from job.core import errors, values
from job.errors import ConfigError
from job.parallel import multihost
from job.runtime import gloo_noise
from job.train import config
from job.train import task as tasks

WHOLE = ["0", "1", "4", "007", "1" + "0" * 20]
NOT_WHOLE = ["", " 4", "4 ", "4\n", "+4", "-1", "1_0", "1e3", "4.0", "\u0664", "4;id", "9" * 31, "four"]
ON = ["1", "true", "TRUE", "yes", "Yes", "on", "ON"]
OFF = ["", "0", "false", "False", "no", "NO", "off"]
NOT_SWITCH = ["2", "maybe", " 1", "1 ", "yes; rm -rf ~", "tru", "\u0661"]


def sides_whole(text: str) -> dict[str, object]:
    """What each side makes of `text` as a count >= 0: the number, or the words of its error."""
    out: dict[str, object] = {}
    for side, parse in (("slurm", lambda t: slurm_options.count("NODES", t, 0)), ("tpu", tpu_cli._count)):
        try:
            out[side] = parse(text)
        except ConfigError as exc:
            out[side] = f"expected {exc.expected}, found {exc.found!r}"
        except argparse.ArgumentTypeError as exc:
            out[side] = str(exc)
    return out


@pytest.mark.parametrize("text", WHOLE + NOT_WHOLE)
def test_every_side_reads_a_whole_number_alike(text: str) -> None:
    got = sides_whole(text)
    assert got["slurm"] == got["tpu"], got
    if text in WHOLE:
        assert got["slurm"] == int(text)
    else:
        assert got["slurm"] == f"expected a whole number >= 0, found {text!r}"


@pytest.mark.parametrize("text", WHOLE + NOT_WHOLE)
def test_the_launcher_reads_its_counts_with_the_same_parser(text: str) -> None:
    expected = int(text) if text in WHOLE and int(text) >= 1 else None
    if expected is None:
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected a whole number >= 1, found "):
            launch.positive_int(text)
    else:
        assert launch.positive_int(text) == expected


@pytest.mark.parametrize("text", ON + OFF + NOT_SWITCH)
def test_slurm_and_tpu_take_the_same_on_off_words(text: str) -> None:
    results = []
    for parse, error in ((lambda t: slurm_options.switch("EXCLUSIVE", t), ConfigError),
                         (tpu_cli._on_off, argparse.ArgumentTypeError)):
        try:
            results.append(parse(text))
        except error as exc:
            results.append("refused" if "expected 1 or 0 (or true/false)" in str(exc) else str(exc))
    assert results[0] == results[1] == (True if text in ON else False if text in OFF else "refused"), results


def test_a_bad_value_says_what_was_expected_and_found() -> None:
    with pytest.raises(values.BadValue) as err:
        values.whole("70000", minimum=1, maximum=65535, what="a TCP port 1..65535")
    assert (err.value.expected, err.value.found) == ("a TCP port 1..65535", "70000")
    assert str(err.value) == "expected a TCP port 1..65535, found '70000'"
    assert values.whole("65535", minimum=1, maximum=65535) == 65535


@pytest.mark.parametrize("text", ["soon", "0", "-1", "inf", "nan", ""])
def test_a_bad_barrier_timeout_is_one_error_naming_the_variable(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(multihost.BARRIER_TIMEOUT, text)
    with pytest.raises(ConfigError) as caught:
        multihost._barrier_timeout_s()
    assert str(caught.value) == (f"JOB_BARRIER_TIMEOUT: expected a finite number of seconds > 0, found {text!r}. "
                                 "Fix: set JOB_BARRIER_TIMEOUT=300 (or any number of seconds > 0), or unset it")


def test_the_barrier_timeout_is_300_s_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(multihost.BARRIER_TIMEOUT, raising=False)
    assert multihost._barrier_timeout_s() == 300
    monkeypatch.setenv(multihost.BARRIER_TIMEOUT, "2.5")
    assert multihost._barrier_timeout_s() == 2.5


@pytest.mark.parametrize("text", WHOLE + NOT_WHOLE)
def test_the_launchers_gpu_count_takes_0_and_the_same_whole_numbers(text: str) -> None:
    if text in WHOLE and int(text) <= launch.MAX_LOCAL:
        assert launch._gpu_count(text) == int(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected a whole number 0\.\.1024, found "):
            launch._gpu_count(text)


@pytest.mark.parametrize("text", ON + NOT_SWITCH)
def test_keeping_gloos_lines_takes_the_same_on_off_words(text: str) -> None:
    if text in ON:
        assert gloo_noise.filter_output({gloo_noise.KEEP_VARIABLE: text}) is None  # kept: no filter started
    else:
        with pytest.raises(ConfigError, match=r"JOB_GLOO_LOGS: expected 1 or 0 \(or true/false\), found "):
            gloo_noise.filter_output({gloo_noise.KEEP_VARIABLE: text})


INTEGER = [*WHOLE, "9" * 31, "-1", "-007"]  # any size: a flag's range is the config's own check
NOT_INTEGER = [text for text in NOT_WHOLE if text not in INTEGER] + ["-", "--1", "- 1", "-+1"]


@pytest.mark.parametrize("text", INTEGER + NOT_INTEGER)
def test_the_configs_integer_flags_take_what_the_launcher_takes_and_a_minus(text: str,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    task = tasks.load("lm")
    if text in INTEGER:
        assert config.parse([f"--seed={text}"], task).seed == int(text)
    else:
        with pytest.raises(SystemExit) as caught:
            config.parse([f"--seed={text}"], task)
        assert caught.value.code == 2 and f"expected an integer, found {text!r}" in capsys.readouterr().err


SECONDS = ["0", "2.5", "1e3", "300"]
NOT_SECONDS = ["", "soon", "-1", "nan", "inf", "-inf", "1e999"]


@pytest.mark.parametrize("text", SECONDS + NOT_SECONDS)
def test_a_duration_is_a_finite_number_of_seconds_and_a_positive_one_is_not_0(text: str) -> None:
    for parse, sign in ((values.seconds, ">="), (values.positive_seconds, ">")):
        if text in SECONDS and (float(text) > 0 or sign == ">="):
            assert parse(text) == float(text)
        else:
            with pytest.raises(values.BadValue) as err:
                parse(text)
            assert str(err.value) == f"expected a number of seconds {sign} 0, found {text!r}"


def test_for_argparse_makes_a_bad_value_argparses_usage_error_in_the_same_words(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="prog")
    parser.add_argument("--n", type=values.for_argparse(values.whole, minimum=1))
    parser.add_argument("--dry-run", type=values.for_argparse(values.switch, fix="DRY_RUN=1"), default=False)
    assert parser.parse_args(["--n", "4", "--dry-run", "yes"]) == argparse.Namespace(n=4, dry_run=True)
    for argv, said in ((["--n", "0"], "argument --n: expected a whole number >= 1, found '0'"),
                       (["--dry-run", "maybe"], ("argument --dry-run: expected 1 or 0 (or true/false), "
                                                 "found 'maybe'. Fix: DRY_RUN=1"))):
        with pytest.raises(SystemExit) as caught:
            parser.parse_args(argv)
        assert caught.value.code == 2 and capsys.readouterr().err.endswith(f"prog: error: {said}\n")


def test_as_config_error_names_the_variable_with_the_parsers_words_unless_given_its_own() -> None:
    with pytest.raises(ConfigError) as caught, errors.as_config_error("NODES", fix="e.g. NODES=4"):
        values.whole("four", minimum=1)
    assert str(caught.value) == "NODES: expected a whole number >= 1, found 'four'. Fix: e.g. NODES=4"
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    with pytest.raises(ConfigError) as caught, errors.as_config_error("IDS", expected="ids such as '0,1'",
                                                                       found=None, fix="set IDS=0,1"):
        values.whole("x")
    assert (caught.value.expected, caught.value.found) == ("ids such as '0,1'", None)
    with errors.as_config_error("NODES", fix="e.g. NODES=4"):
        assert values.whole("4") == 4
    with pytest.raises(ValueError, match="^not a BadValue$"), errors.as_config_error("NODES", fix="e.g. NODES=4"):
        raise ValueError("not a BadValue")  # anything else goes through as it is
