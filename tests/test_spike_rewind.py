"""Issue 39, item 4: ``--spike-rewind Z,K[,R]`` (`mp_toolkit.run.spikes`).

One rank in this process (gpt-tiny, synthetic data, fp32, AdamW); the spike is the test-only
``MPT_FAULTS`` ``spike`` (a global batch whose logits are scaled by 30: a bad batch, read by whichever
step reaches it), the non-finite streak its ``nonfinite`` gradients.
"""

import json

import pytest
import torch

from mp_toolkit.checkpoint import latest_step
from mp_toolkit.cli import main
from mp_toolkit.data.lm import MicroBatches, SyntheticSamples
from mp_toolkit.flag_values import SpikeRewindError, parse_spike_rewind
from mp_toolkit.run.spikes import MIN_STEPS, SpikeGuard
from tests.fault_workers import differing, tensors

RUN = ["train", "--model", "gpt-tiny", "--pp", "1", "--data", "synthetic", "--seq-len", "16", "--micro-batch", "2",
       "--microbatches", "2", "--threads", "1", "--no-progress", "--lr", "1e-3", "--save-every", "5"]


def test_the_flag_is_parsed_and_bounded():
    assert parse_spike_rewind("4,20") == (4.0, 20, 3)
    assert parse_spike_rewind("2.5,1,7") == (2.5, 1, 7)
    assert parse_spike_rewind("off") is None
    for bad in ("4", "0,3", "-1,3", "inf,3", "4,0", "4,3,0", "4,3,1,1", "a,b", "nan,3"):
        with pytest.raises(SpikeRewindError, match="--spike-rewind"):
            parse_spike_rewind(bad)


def test_the_guard_judges_against_its_window_and_keeps_it_across_a_checkpoint():
    guard = SpikeGuard.of((3.0, 5, 2))
    losses = [5.0 + 0.01 * (i % 3) for i in range(MIN_STEPS)]
    for step, loss in enumerate(losses, 1):
        assert guard.judge(step, loss, skipped=False) is None
    assert guard.judge(MIN_STEPS + 1, float("nan"), skipped=True) is None  # non-finite: the skip streak's job
    why = guard.judge(MIN_STEPS + 1, 6.0, skipped=False)
    assert why is not None and "standard deviations above the last 10 steps' mean" in why
    assert guard.judge(MIN_STEPS + 1, 5.01, skipped=False) is None  # an ordinary loss joins the window
    resumed = SpikeGuard.of((3.0, 5, 2), json.loads(json.dumps(guard.state())))
    assert list(resumed.losses) == list(guard.losses) and resumed.rewinds == 0
    guard.rewound(4)
    assert [s for s, _ in guard.losses] == [1, 2, 3, 4] and guard.rewinds == 1 and guard.left == 1
    assert SpikeGuard.of((3.0, 5, 2), {"losses": [["x", 1.0], [3, "y"], [2, float("inf")]], "rewinds": -4}
                         ).state() == {"losses": [], "rewinds": 0}  # a crafted manifest is not obeyed


def test_skipping_micro_batches_lands_where_drawing_them_does():
    """Across epoch ends: skip(n) then next() is the (n+1)-th draw."""
    samples = SyntheticSamples(50, 8, seed=3, count=23)
    for n in (0, 1, 4, 5, 11, 17, 40):
        drawn, skipped = MicroBatches(samples, 2, dp_rank=1, dp_size=2), MicroBatches(samples, 2, dp_rank=1, dp_size=2)
        for _ in range(n):
            next(drawn)
        skipped.skip(n)
        assert skipped.state_dict() == drawn.state_dict(), n
        assert torch.equal(next(skipped)[0], next(drawn)[0]), n


def train(capsys, monkeypatch, root, *args, faults=None) -> tuple[int, str]:
    if faults is not None:
        monkeypatch.setenv("MPT_FAULTS", json.dumps(faults))
    code = main([str(a) for a in [*RUN, "--save-dir", root, *args]])
    out = capsys.readouterr()
    return code, out.out + out.err


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_spike_rewinds_skips_the_bad_batch_and_a_resumed_run_reproduces_it(tmp_path, capsys, monkeypatch):
    """Global batch 17 spikes at step 17: back to step 15, batches 16-18 skipped, steps 16.. trained on
    batches 19..; the metrics hold each step once. Global batch 27 (read by step 24 after the skip)
    spikes too, with the one rewind spent: logged, not rewound. A run stopped at step 20 and resumed to 30
    ends bitwise as the uninterrupted one."""
    faults = {"spike": [{"rank": 0, "batch": 17}, {"rank": 0, "batch": 27}]}
    code, out = train(capsys, monkeypatch, tmp_path / "a", "--steps", "30", "--spike-rewind", "4,3,1",
                      "--metrics", tmp_path / "a.jsonl", faults=faults)
    assert code == 0, out
    assert ("step 17: loss " in out and "standard deviations above the last 16 steps' mean" in out
            and "rewound to step-00000015, skipping global batches 16-18 (rewind 1 of 1)" in out), out
    assert "step 24: loss " in out and "not rewound: the 1 rewinds of --spike-rewind are spent" in out, out
    got = rows(tmp_path / "a.jsonl")
    assert [r["step"] for r in got] == list(range(1, 31))
    assert max(r["loss"] for r in got[15:23]) < got[23]["loss"]  # the bad batch 17 is gone, 27 is in

    code, out = train(capsys, monkeypatch, tmp_path / "b", "--steps", "20", "--spike-rewind", "4,3,1",
                      "--metrics", tmp_path / "b.jsonl", faults=faults)
    assert code == 0 and "rewound to step-00000015" in out, out
    code, out = train(capsys, monkeypatch, tmp_path / "b", "--steps", "30", "--spike-rewind", "4,3,1",
                      "--metrics", tmp_path / "b.jsonl", "--resume", "auto", faults=faults)
    assert code == 0 and "not rewound" in out, out
    assert [r["loss"] for r in rows(tmp_path / "b.jsonl")] == [r["loss"] for r in got]
    assert latest_step(tmp_path / "b") == 30 and differing(tensors(tmp_path / "b"), tensors(tmp_path / "a")) == []


def test_a_non_finite_streak_rewinds_then_stops_once_rewinds_are_spent(tmp_path, capsys, monkeypatch):
    """--max-skips 2 non-finite steps (12, 13) rewind to step 10 instead of stopping; the same steps fail
    again after it and, with R = 1 spent, the run stops as without the flag (exit 3)."""
    code, out = train(capsys, monkeypatch, tmp_path / "ck", "--steps", "20", "--max-skips", "2",
                      "--spike-rewind", "4,2,1", faults={"nonfinite": [{"rank": 0, "steps": [12, 13]}]})
    assert code == 3, out
    assert ("step 13: 2 consecutive steps skipped (--max-skips 2) in fp32: rewound to step-00000010, skipping "
            "global batches 11-12 (rewind 1 of 1)") in out, out
    assert "2 consecutive steps skipped (steps 12-13)" in out and latest_step(tmp_path / "ck") == 10


def test_the_flag_needs_checkpoints(tmp_path, capsys):
    code = main([*RUN[:-2], "--spike-rewind", "4,3"])
    assert code == 2 and "--spike-rewind needs --save-dir and --save-every N" in capsys.readouterr().err
