"""Variable sequence lengths (issue 21 item 3) through the data and `mpt train`.

The engine side -- micro-batches of mixed lengths bitwise equal to one process under 1F1B, ZB-H1 and
interleaved 1F1B, and with tp / dp -- is the oracle's (tests/test_oracle.py, tests/test_oracle_tp_dp.py).
Here: the length buckets cut each micro-batch deterministically (padding only, for BERT's pairs),
a resumed run changes --seq-len, and --length-buckets runs through `mpt train` on pp=2.
"""

import json

import numpy as np
import pytest
import torch

from mp_toolkit.data.buckets import BucketError, cut, drawn_bucket, parse_buckets, with_seq_len
from mp_toolkit.data.feed import Wanted, feed
from mp_toolkit.data.lm import MicroBatches, SyntheticSamples
from mp_toolkit.data.synthetic import synthetic_documents
from tests.cli_helpers import assert_one_line_exit_2
from tests.test_resume import mpt

RUN = ["train", "--model", "gpt-tiny", "--data", "synthetic", "--micro-batch", "2", "--threads", "1", "--no-progress",
       "--timeout", "60", "--lr", "1e-2"]  # gpt-tiny: 64 positions


def test_bucket_arguments():
    assert parse_buckets("64,16,32,16") == (16, 32, 64)
    assert with_seq_len((16, 32), 64) == (16, 32, 64) and with_seq_len((), 64) == ()
    for bad in ("16,x", "0,16", ""):
        with pytest.raises(BucketError):
            parse_buckets(bad)
    with pytest.raises(BucketError, match="128 > --seq-len 64"):
        with_seq_len((32, 128), 64)


def test_packed_micro_batches_cut_to_drawn_buckets_deterministically():
    ds, _ = SyntheticSamples.split(50, 16, seed=3, tokens=17 * 64, holdout=0)
    whole = MicroBatches(ds, 4, seed=3)
    cut_ = MicroBatches(ds, 4, seed=3, length_buckets=(4, 8, 16))
    again = MicroBatches(ds, 4, seed=3, length_buckets=(4, 8, 16))
    lengths = []
    for _ in range(24):  # past the end of the first epoch (16 micro-batches)
        (x, y), (cx, cy), (ax, ay) = next(whole), next(cut_), next(again)
        n = cx.shape[1]
        lengths.append(n)
        assert torch.equal(cx, x[:, :n]) and torch.equal(cy, y[:, :n]) and cx.is_contiguous()
        assert torch.equal(cx, ax) and torch.equal(cy, ay)  # the same cut on every rank and every run
    assert set(lengths) == {4, 8, 16}
    # the draw depends on (seed, epoch, first row) only: a resumed iterator cuts alike
    resumed = MicroBatches(ds, 4, seed=3, length_buckets=(4, 8, 16))
    resumed.load_state_dict({"epoch": 1, "position": 20})
    assert [next(resumed)[0].shape[1] for _ in range(4)] == lengths[20:24]
    assert drawn_bucket((4, 8, 16), 3, 0, 5) == drawn_bucket((4, 8, 16), 3, 0, 5)


def test_bert_pairs_lose_only_padding(tmp_path):
    # short documents, so pairs fall short of --seq-len (46 to 64 tokens here) and carry padding
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                 for t in synthetic_documents(0, docs=96, lines=3, words=5)))
    fed = feed(str(tmp_path / "docs.jsonl"), Wanted(300, 64, 0, pairs=True), tmp_path / "cache", total=64)
    buckets = (40, 48, 56, 64)
    whole = MicroBatches(fed.train, 1, seed=0)
    cut_ = MicroBatches(fed.train, 1, seed=0, length_buckets=buckets)
    seen = set()
    for _ in range(12):
        (ids, types, mask), (mlm, nsp) = next(whole)
        (cids, ctypes, cmask), (cmlm, cnsp) = next(cut_)
        n = cids.shape[1]
        seen.add(n)
        longest = int(mask.sum(1).max())
        assert n >= longest and all(b < longest for b in buckets if b < n)  # the smallest that holds the longest
        assert int(mask[:, n:].sum()) == 0 and bool((mlm[:, n:] == -100).all())  # only padding was cut
        assert all(torch.equal(a[:, :n], b) for a, b in ((ids, cids), (types, ctypes), (mask, cmask), (mlm, cmlm)))
        assert torch.equal(nsp, cnsp)
    assert len(seen) > 1, seen


def test_cut_keeps_one_dimensional_labels():
    batch = ((torch.zeros(2, 8), torch.ones(2, 8)), (torch.zeros(2, 8, dtype=torch.long), torch.arange(2)))
    (a, b), (c, d) = cut(batch, 3)
    assert a.shape == b.shape == c.shape == (2, 3) and torch.equal(d, torch.arange(2))


def test_seq_len_beyond_the_models_positions_is_refused_on_resume(capsys, tmp_path):
    assert_one_line_exit_2(capsys,
                           [*RUN, "--seq-len", "128", "--pp", "2", "--save-dir", tmp_path, "--resume", "latest"],
                           mentions="--seq-len 128 exceeds gpt-tiny's 64 positions")
    assert_one_line_exit_2(capsys, [*RUN, "--seq-len", "16", "--length-buckets", "8,32"], mentions="32 > --seq-len 16")
    assert_one_line_exit_2(capsys, [*RUN, "--length-buckets", "16,x"], mentions="--length-buckets '16,x'")


def test_resume_with_another_seq_len_and_length_buckets(tmp_path):
    """pp=2 1F1B: 2 steps at --seq-len 16, saved; resumed at --seq-len 32 with --length-buckets 8,16 and
    an evaluation (its held-out micro-batches cut alike) to step 5: every loss finite, the change said."""
    metrics = tmp_path / "b.jsonl"
    common = [*RUN, "--microbatches", "4", "--pp", "2", "--save-dir", tmp_path / "ck"]
    first = mpt(*map(str, [*common, "--seq-len", "16", "--steps", "2", "--save-every", "2"]))
    assert first.returncode == 0, first.stdout + first.stderr
    second = mpt(*map(str, [*common, "--seq-len", "32", "--length-buckets", "8,16", "--steps", "5", "--save-every",
                            "5", "--resume", "latest", "--eval-every", "5", "--eval-batches", "1",
                            "--metrics", metrics]))
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    assert "at step 2" in out and "--seq-len changed 16 -> 32" in out, out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r and "step" in r]
    assert [r["step"] for r in train_rows] == [3, 4, 5]
    assert all(np.isfinite(r["loss"]) for r in train_rows)
    assert np.isfinite(train_rows[-1]["val_loss"])
    # tokens: what the 4 micro-batches of 2 held after their cut to 8, 16 or 32 (not 4 x 2 x 32 each step)
    tokens = [r["tokens"] for r in train_rows]
    assert all(t % 16 == 0 and 4 * 2 * 8 <= t <= 4 * 2 * 32 for t in tokens) and min(tokens) < 4 * 2 * 32, tokens
    assert all(r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"]) for r in train_rows)


def replica_tokens(rank, world, drawn):
    """`global_batch_tokens` on a pp=2 x dp=2 grid where each rank drew ``drawn[rank]`` tokens."""
    from mp_toolkit.parallel.context import build_context
    from mp_toolkit.run.metrics import global_batch_tokens

    return global_batch_tokens(drawn[rank], build_context(pp=2, tp=1, dp=2))


def test_a_global_batch_counts_each_replica_once():
    """Ranks (pp, dp) = (0,0), (0,1), (1,0), (1,1) are 0, 1, 2, 3: replica 0's stages drew 96 and 0
    (the last stage read nothing), replica 1's 64 and 64 -- 96 + 64 on every rank."""
    from tests.dist_harness import run_world

    assert run_world(replica_tokens, 4, [96, 64, 0, 64], timeout_s=120) == [160] * 4
