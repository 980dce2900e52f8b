"""Hostile but valid (issue 22 item 5): accepted, unusual combinations through `mpt train`.

Hypothesis draws layout, schedule, precision, optimizer, data and checkpoint flags, and DeepSpeed
JSON files for ``--config``; every run of a tiny model for 1-2 steps either trains (exit 0) or is
refused in one line (exit 2): no traceback, no hang, no process left behind.

In the suite: a few derandomized one-rank examples, each run in this process (`main`, as the CLI
runs a one-rank job); ``MPT_FUZZ_IN_PROCESS=N`` draws N random ones instead. Outside it,
``MPT_FUZZ_EXAMPLES=200`` runs that many examples each as its own ``mpt train`` process (up to 2
ranks, started by mpt itself) under a time limit, and checks that no process of the job outlives
it::

    MPT_FUZZ_EXAMPLES=200 MPT_FUZZ_LOG=fuzz.jsonl \\
        .venv/bin/python -m pytest -q tests/test_hostile_valid.py -k process -s
"""

import json
import os
import signal
import subprocess
import sys
import uuid

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mp_toolkit.cli import main

FUZZ_EXAMPLES = int(os.environ.get("MPT_FUZZ_EXAMPLES", "0"))
IN_PROCESS_EXAMPLES = int(os.environ.get("MPT_FUZZ_IN_PROCESS", "8"))
HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
WORDS = "the pipeline cuts a model into stages and each stage runs its micro batches in order".split()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A tokenizer cache shared by every example (a BPE is trained once) and a small text corpus."""
    root = tmp_path_factory.mktemp("hostile_valid")
    corpus = root / "corpus.jsonl"  # 30 documents (BERT's sentence pairs need more than one)
    corpus.write_text("\n".join(
        json.dumps({"text": "\n".join(" ".join(WORDS[(d + i * 7 + j) % len(WORDS)] for j in range(12))
                                      for i in range(10))}) for d in range(30)))
    return {"cache": root / "cache", "corpus": corpus, "root": root}


def _flag(name, strategy):
    """``[name, value]`` or nothing."""
    return st.one_of(st.just([]), strategy.map(lambda v: [name, str(v)]))


@st.composite
def layouts(draw, max_world):
    pp = draw(st.sampled_from([1, 2] if max_world > 1 else [1]))
    tp = draw(st.sampled_from([1, 2] if max_world // pp > 1 else [1]))
    dp = draw(st.sampled_from([1, 2] if max_world // (pp * tp) > 1 else [1]))
    return ["--pp", str(pp), "--tp", str(tp), "--dp", str(dp)]


@st.composite
def train_args(draw, max_world, shared):
    model = draw(st.sampled_from(["gpt-tiny", "gpt-tiny", "bert-tiny"]))
    args = ["train", "--model", model, *draw(layouts(max_world)), "--steps", str(draw(st.integers(1, 2))),
            "--seq-len", str(draw(st.sampled_from([8, 16, 32]))), "--micro-batch", str(draw(st.integers(1, 3))),
            "--microbatches", str(draw(st.integers(1, 4))), "--threads", "1", "--no-progress", "--timeout", "60",
            "--cache-dir", str(shared["cache"])]
    texts = [str(shared["corpus"])] if model == "bert-tiny" else []  # gpt-tiny's 256 ids are too few for a BPE
    args += ["--data", draw(st.sampled_from(["synthetic", "synthetic", *texts]))]
    args += draw(_flag("--schedule", st.sampled_from(["gpipe", "1f1b", "interleaved", "zbh1", "auto"])))
    args += draw(_flag("--precision", st.sampled_from(["fp32", "bf16", "fp16", "auto"])))
    args += draw(_flag("--optimizer", st.sampled_from(["adamw", "adam", "adagrad", "rmsprop", "sgd", "lamb", "lars"])))
    args += draw(_flag("--lr", st.sampled_from([1e-6, 1e-3, 0.5, 10.0])))
    args += draw(_flag("--clip-grad", st.sampled_from(["none", "0.01", "1.0"])))
    args += draw(_flag("--weight-decay", st.sampled_from([0.0, 0.1])))
    args += draw(_flag("--warmup-steps", st.integers(0, 3)))
    args += draw(_flag("--lr-decay", st.sampled_from(["linear", "cosine", "none"])))
    args += draw(_flag("--loss-scale", st.sampled_from([0, 1, 1024])))
    args += draw(_flag("--recompute", st.sampled_from(["none", "full", "selective"])))
    args += draw(_flag("--zero", st.sampled_from([0, 1])))
    args += draw(_flag("--partition", st.sampled_from(["uniform", "parameters", "flops"])))
    args += draw(_flag("--eval-every", st.integers(0, 1)))
    args += draw(_flag("--max-skips", st.integers(1, 3)))
    if draw(st.booleans()):
        args += ["--save-dir", str(shared["root"] / f"ck-{uuid.uuid4().hex[:8]}"),
                 *draw(_flag("--save-every", st.integers(0, 1))), *draw(_flag("--keep", st.integers(0, 2)))]
    return args


@st.composite
def ds_configs(draw):
    """A DeepSpeed config of keys mp_toolkit understands, with values DeepSpeed accepts."""
    cfg = {"train_micro_batch_size_per_gpu": draw(st.integers(1, 3)),
           "gradient_accumulation_steps": draw(st.integers(1, 4))}
    if draw(st.booleans()):
        cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    if draw(st.booleans()):
        cfg["gradient_clipping"] = draw(st.sampled_from([0, 0.5, 1.0]))
    precision = draw(st.sampled_from(["fp32", "fp16", "bf16"]))
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, **draw(st.fixed_dictionaries({}, optional={
            "loss_scale": st.sampled_from([0, 128]), "initial_scale_power": st.integers(0, 16),
            "loss_scale_window": st.integers(1, 1000), "hysteresis": st.integers(1, 3),
            "min_loss_scale": st.sampled_from([1, 0.5])}))}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    kind = draw(st.sampled_from(["Adam", "AdamW", "Lamb", "Lars", None]))
    if kind is not None:
        params = {"lr": draw(st.sampled_from([1e-4, 1e-2])), "weight_decay": draw(st.sampled_from([0.0, 0.01]))}
        if kind != "Lars":
            params["betas"] = [0.9, draw(st.sampled_from([0.95, 0.999]))]
        cfg["optimizer"] = {"type": kind, "params": params}
        sched = draw(st.sampled_from(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", None]))
        if sched == "WarmupLR":
            cfg["scheduler"] = {"type": sched, "params": {"warmup_num_steps": draw(st.integers(1, 3))}}
        elif sched == "WarmupDecayLR":
            cfg["scheduler"] = {"type": sched,
                                "params": {"warmup_num_steps": 1, "total_num_steps": draw(st.integers(2, 10))}}
        elif sched == "WarmupCosineLR":
            cfg["scheduler"] = {"type": sched,
                                "params": {"warmup_num_steps": 1, "total_num_steps": draw(st.integers(2, 10))}}
    if draw(st.booleans()):
        cfg["zero_optimization"] = {"stage": draw(st.sampled_from([0, 1]))}
    if draw(st.booleans()):
        cfg["pipeline"] = {"stages": 1, **draw(st.fixed_dictionaries({}, optional={
            "partition_method": st.sampled_from(["parameters", "uniform"]),
            "schedule": st.sampled_from(["1f1b", "gpipe"])}))}
    if draw(st.booleans()):
        cfg["steps_per_print"] = draw(st.integers(1, 100))
    return cfg


@st.composite
def examples(draw, max_world, shared):
    if draw(st.integers(0, 3)) == 0:  # a DeepSpeed JSON through --config, with a few flags
        path = shared["root"] / f"ds-{uuid.uuid4().hex[:8]}.json"
        path.write_text(json.dumps(draw(ds_configs())))
        return ["train", "--config", str(path), "--model", draw(st.sampled_from(["gpt-tiny", "bert-tiny"])),
                "--data", "synthetic", "--seq-len", "16", "--steps", str(draw(st.integers(1, 2))), "--threads", "1",
                "--no-progress", "--timeout", "60", "--cache-dir", str(shared["cache"])]
    return draw(train_args(max_world, shared))


def _check_outcome(code, err, argv) -> None:
    """Trained (0), or refused (2) or diverged (3: --max-skips non-finite steps, RELIABILITY.md) in one line."""
    assert "Traceback" not in err, (argv, err)
    if code in (2, 3):
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1, (argv, err)
    else:
        assert code == 0, (argv, code, err)


@settings(max_examples=IN_PROCESS_EXAMPLES, derandomize=IN_PROCESS_EXAMPLES == 8, deadline=None,
          suppress_health_check=HEALTH, database=None)
@given(data=st.data())
def test_accepted_combinations_train_or_are_refused_in_one_line(shared, capsys, data):
    argv = data.draw(examples(1, shared))
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    if "MPT_FUZZ_LOG" in os.environ:
        with open(os.environ["MPT_FUZZ_LOG"], "a") as log:
            log.write(json.dumps({"argv": argv, "code": code, "err": err[-3000:]}) + "\n")
    _check_outcome(code, err, argv)


FUZZ_LOG = os.environ.get("MPT_FUZZ_LOG", "fuzz.jsonl")


@pytest.mark.skipif(FUZZ_EXAMPLES == 0, reason="set MPT_FUZZ_EXAMPLES=N to run N examples as processes")
@pytest.mark.timeout(0)  # N examples of seconds each; every one is bounded below
@settings(max_examples=max(FUZZ_EXAMPLES, 1), deadline=None, suppress_health_check=HEALTH, database=None)
@given(data=st.data())
def test_accepted_combinations_in_processes(shared, data):
    """Each example's outcome goes to MPT_FUZZ_LOG (JSON lines) rather than stopping the run at the
    first bad one; `test_the_process_examples_all_passed` then reads the log."""
    argv = data.draw(examples(2, shared))
    proc = subprocess.Popen([sys.executable, "-m", "mp_toolkit.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True, text=True)
    try:
        _, err = proc.communicate(timeout=240)  # a bound against a hang: a tiny run takes seconds
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        hung = True
    left = [p.pid for p in psutil.process_iter() if _in_session(p, proc.pid)]
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        _check_outcome(proc.returncode, err, argv)
        problem = "hung" if hung else ("processes left" if left else None)
    except AssertionError:
        problem = "traceback" if "Traceback" in err else f"exit {proc.returncode}, {err.count(chr(10))} lines"
    with open(FUZZ_LOG, "a") as log:
        log.write(json.dumps({"argv": argv, "code": proc.returncode, "problem": problem, "err": err[-3000:]}) + "\n")


@pytest.mark.skipif(FUZZ_EXAMPLES == 0, reason="set MPT_FUZZ_EXAMPLES=N to run N examples as processes")
def test_the_process_examples_all_passed():
    rows = [json.loads(line) for line in open(FUZZ_LOG)]
    bad = [r for r in rows if r["problem"]]
    print(f"\n{len(rows)} examples: {sum(r['code'] == 0 for r in rows)} trained, "
          f"{sum(r['code'] in (2, 3) for r in rows)} refused or diverged in one line, {len(bad)} bad")
    assert not bad, bad[:3]


def _in_session(p: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(p.pid) == sid
    except (ProcessLookupError, PermissionError):
        return False
