"""Hostile arguments and configs end with exit code 2 and one line, never a traceback (issue 9, item 5).

Property-based: hypothesis draws numbers out of range, wrong types, unicode, huge values and
empty files for `mpt plan`, `mpt simulate`, `mpt train` (only values that fail validation, so
no training starts) and DeepSpeed JSON configs.
"""

import json

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mp_toolkit.ds.config import read_ds_config
from mp_toolkit.run.config import ConfigError
from mp_toolkit.user_files import special_kind, write_output
from tests.cli_helpers import assert_one_line_exit_2

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

junk_text = st.one_of(
    st.text(min_size=0, max_size=12),
    st.sampled_from(["", "-1", "0", "1e400", "nan", "inf", "-inf", "１２", "0x10", "3.5", "None", "🙂", "9" * 40]),
)
def _parses(text: str, kind) -> bool:
    try:
        value = kind(text)
    except ValueError:
        return False
    return value > 0 and value != float("inf")  # a usable positive number


not_positive = st.one_of(st.integers(max_value=0), junk_text.filter(lambda s: not _parses(s, int)))
bad_int = st.one_of(not_positive, st.integers(min_value=10**9, max_value=10**30))  # huge: beyond any model
bad_float = st.one_of(st.sampled_from(["nan", "-1", "0", "-inf", "inf", "abc", "", "1e400"]),
                      st.text(max_size=6).filter(lambda s: not _parses(s, float)))


def one_line_exit_2(capsys, argv) -> None:
    assert_one_line_exit_2(capsys, argv)


PLAN = ["plan", "--model", "gpt-tiny", "--pp", "2", "--seq-len", "16", "--tflops", "0.05"]


@SETTINGS
@given(flag=st.sampled_from(["--pp", "--tp", "--dp", "--micro-batch", "--microbatches", "--seq-len", "--chunks"]),
       value=not_positive)
def test_plan_bad_integers(capsys, flag, value):
    one_line_exit_2(capsys, PLAN + [flag, value])


@SETTINGS
@given(flag=st.sampled_from(["--pp", "--tp", "--microbatches", "--seq-len", "--chunks"]),
       value=st.integers(min_value=10**9, max_value=10**30))
def test_plan_huge_integers_the_model_cannot_take(capsys, flag, value):
    extra = ["--schedule", "interleaved"] if flag == "--chunks" else []
    one_line_exit_2(capsys, PLAN + extra + [flag, value])


@SETTINGS
@given(flag=st.sampled_from(["--memory-gb", "--tflops", "--p2p-gbps", "--mem-gbps"]), value=bad_float)
def test_plan_bad_floats(capsys, flag, value):
    extra = ["--method", "memory"] if flag != "--memory-gb" else ["--method", "memory"]
    if flag != "--memory-gb":
        extra += ["--memory-gb", "1"]
    one_line_exit_2(capsys, PLAN + extra + [flag, value])


@SETTINGS
@given(flag=st.sampled_from(["--method", "--schedule", "--dtype", "--optimizer", "--model"]), value=junk_text)
def test_plan_bad_names(capsys, flag, value):
    one_line_exit_2(capsys, PLAN + [flag, value + "\u2603"])


@SETTINGS
@given(flag=st.sampled_from(["--pp", "--microbatches", "--chunks"]), value=bad_int)
def test_simulate_bad_numbers(capsys, flag, value):
    one_line_exit_2(capsys, ["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", flag, value])


TRAIN = ["train", "--model", "gpt-tiny", "--pp", "1", "--data", "synthetic", "--steps", "1", "--no-progress"]


@SETTINGS
@given(flag=st.sampled_from(["--pp", "--tp", "--dp", "--microbatches", "--micro-batch", "--seq-len", "--steps"]),
       value=not_positive)
def test_train_bad_integers(capsys, flag, value):
    one_line_exit_2(capsys, TRAIN + [flag, value])


@SETTINGS
@given(flag=st.sampled_from(["--lr", "--weight-decay", "--min-lr", "--loss-scale", "--min-loss-scale"]),
       value=st.sampled_from(["-1", "nan", "-inf", "abc", "", "1e400x"]))
def test_train_bad_floats(capsys, flag, value):
    one_line_exit_2(capsys, TRAIN + [flag, value])


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-10**20, max_value=10**20),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=10,
)
DS_KEYS = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
           "fp16", "bf16", "optimizer", "scheduler", "pipeline", "zero_optimization", "steps_per_print"]


@SETTINGS
@given(config=st.dictionaries(st.sampled_from(DS_KEYS) | st.text(max_size=8), json_values, max_size=6),
       dp=st.integers(min_value=1, max_value=8))
def test_ds_config_random_json_is_accepted_or_refused_cleanly(config, dp):
    try:
        settings_ = read_ds_config(config, dp=dp)
    except ConfigError as e:
        assert len(str(e).splitlines()) == 1
    else:
        assert settings_.train_micro_batch_size_per_gpu >= 1


@pytest.mark.parametrize("content", [b"", b"   ", b"{", b"[]", b"null", b"\xff\xfe\x00", b'{"train_batch_size": "8"}',
                                     b'{"train_batch_size": 8, "train_batch_size": 16}'])
def test_ds_config_files_that_are_not_configs(tmp_path, content):
    path = tmp_path / "ds_config.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        read_ds_config(str(path))
    assert len(str(e.value).splitlines()) == 1


def test_plan_config_file_that_is_empty_or_huge(tmp_path, capsys):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    one_line_exit_2(capsys, ["plan", "--model", str(empty), "--pp", "2"])
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"model_type": "gpt2", "n_embd": 10**12, "n_head": 7, "n_layer": 10**9}))
    one_line_exit_2(capsys, ["plan", "--model", str(huge), "--pp", "2", "--tflops", "1"])


@pytest.mark.parametrize("args, words", [
    (["--microbatches", "1000000000", "--dry-run"], "--microbatches 1000000000 is more than a step schedules "
                                                    "(at most 65536"),
    (["--precision", "fp16", "--initial-scale-power", "100000"], "--initial-scale-power 100000 is out of range"),
])
def test_train_refuses_sizes_before_planning_or_building(capsys, args, words):
    """Issue 40, class 1 and 6: mpt train bounds what mpt plan bounds, before the schedule is built."""
    assert_one_line_exit_2(capsys, ["train", "--model", "gpt-tiny", "--data", "synthetic", *args], words)


def test_a_ds_config_scale_power_out_of_range_is_refused_with_its_key(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                "fp16": {"enabled": True, "initial_scale_power": 100000}}))
    line = assert_one_line_exit_2(capsys, ["train", "--model", "gpt-tiny", "--data", "synthetic", "--config", path])
    assert "initial_scale_power" in line and "out of range" in line, line


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("kind", ["ds-config", "jsonl-corpus", "plan-hf-config", "train-hf-config"])
def test_json_nested_too_deeply_is_refused_in_one_line(tmp_path, capsys, kind):
    """Issue 40, class 5: a DeepSpeed config, a JSON-lines corpus line or an HF config.json nested 10^5 deep."""
    if kind == "ds-config":
        (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2, "x": ' + DEEP + "}")
        argv = ["train", "--model", "gpt-tiny", "--config", tmp_path / "ds.json"]
    elif kind == "jsonl-corpus":
        (tmp_path / "c.jsonl").write_text('{"text": "hello world"}\n{"text": ' + DEEP + "}\n")
        argv = ["train", "--model", "gpt-tiny", "--pp", "1", "--data", tmp_path / "c.jsonl", "--cache-dir",
                tmp_path / "cache"]
    else:
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "config.json").write_text('{"model_type": "gpt2", "x": ' + DEEP + "}")
        safetensors.torch.save_file({"x": torch.zeros(1)}, str(tmp_path / "hf" / "model.safetensors"))
        argv = (["plan", "--model", tmp_path / "hf" / "config.json"] if kind == "plan-hf-config"
                else ["train", "--hf", tmp_path / "hf"])
    assert_one_line_exit_2(capsys, argv, "nested too deeply")


TRAIN_TINY = ["train", "--pp", "1", "--model", "gpt-tiny", "--seq-len", "16", "--steps", "1"]


@pytest.mark.parametrize("argv", [TRAIN_TINY + ["--save-dir", "\x00"], TRAIN_TINY + ["--cache-dir", "run\x00s"],
                                  TRAIN_TINY + ["--metrics", "m\x00.jsonl"], PLAN + ["--json", "\x00"],
                                  ["plan", "--model", "\x00"]])
def test_a_nul_byte_in_an_argument_is_one_line(capsys, tmp_path, monkeypatch, argv):
    """A name no file can have (a Python caller can pass one; a shell cannot): one line, not os.stat's
    ValueError, and nothing written."""
    monkeypatch.chdir(tmp_path)
    assert "NUL byte" in assert_one_line_exit_2(capsys, argv)
    assert list(tmp_path.iterdir()) == []


def test_the_library_guards_refuse_a_nul_byte_too(tmp_path):
    """`user_files`, for callers other than the command line: a NUL name is nothing there to
    `special_kind`, and an output named so is one ConfigError line."""
    assert special_kind("a\x00b") is None
    with pytest.raises(ConfigError, match="NUL byte"):
        write_output("--json", tmp_path / "a\x00b", "{}")
    assert list(tmp_path.iterdir()) == []
