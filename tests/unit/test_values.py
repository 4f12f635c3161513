"""One parser per kind of value (job/core/values.py): the launcher, the Slurm make variables and the TPU
make variables take the same words and refuse the same ones, with the same expected / found words."""

from __future__ import annotations

import argparse

import pytest

from deploy.slurm import options as slurm_options
from deploy.tpu import cli as tpu_cli
from job import launch
from job.core import values
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
                         (tpu_cli._flag, argparse.ArgumentTypeError)):
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
        assert gloo_noise.filter_output({gloo_noise.KEEP: text}) is None  # kept: no filter started
    else:
        with pytest.raises(ConfigError, match=r"JOB_GLOO_LOGS: expected 1 or 0 \(or true/false\), found "):
            gloo_noise.filter_output({gloo_noise.KEEP: text})


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
