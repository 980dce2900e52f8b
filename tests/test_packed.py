"""Packed causal-LM samples over memory-mapped shards, one replica's micro-batches, and blends.

The corpora are written with `IndexedWriter` (no tokenizer needed): document d of shard s holds ids
that name it, so a test can tell where every token came from.
"""
import json
import os

import numpy as np
import pytest
import torch

from mp_toolkit.data.blend import BlendedSamples, assignment
from mp_toolkit.data.indexed import IndexedDataset, IndexedWriter
from mp_toolkit.data.lm import MicroBatches, SyntheticSamples
from mp_toolkit.data.packed import PackedSamples
from mp_toolkit.data.rows import FileRows
from mp_toolkit.errors import DataError
from mp_toolkit.run.data_position import data_position, data_state

EOD = 0


def write_corpus(root, shards=2, docs=9, seed=0, base=1):
    """Shards of documents of 2..40 ids (each ending with EOD); returns (shards opened, documents)."""
    rng = np.random.default_rng(seed)
    documents, out = [], []
    for s in range(shards):
        with IndexedWriter(root / f"shard{s}", np.uint16) as w:
            for _ in range(docs):
                doc = np.append(rng.integers(base, base + 500, size=int(rng.integers(1, 40))), EOD)
                documents.append(doc)
                w.add_document([doc])
            w.finalize()
        out.append(IndexedDataset(root / f"shard{s}"))
    return out, documents


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path)


def epoch_stream(samples, documents, epoch):
    samples.order(epoch)  # builds the epoch's index
    order = np.load(samples.cache / f"e{epoch}-documents.npy")
    assert sorted(order.tolist()) == list(range(len(documents)))  # every document once per epoch
    return np.concatenate([documents[d] for d in order])


def test_samples_are_the_epochs_shuffled_documents_cut_into_overlapping_windows(corpus, tmp_path):
    shards, documents = corpus
    L = 8
    samples = PackedSamples(shards, L, seed=3, cache_dir=tmp_path / "cache")
    total = sum(len(d) for d in documents)
    assert len(samples) == (total - 1) // L
    for epoch in (0, 1):
        stream = epoch_stream(samples, documents, epoch)
        for row in range(len(samples)):  # sample i: tokens [i L, i L + L + 1) of the epoch's concatenation
            np.testing.assert_array_equal(samples.sample(row, epoch), stream[row * L : row * L + L + 1])
        order = samples.order(epoch)
        assert sorted(order.tolist()) == list(range(len(samples)))
    assert samples.order(0).tolist() != samples.order(1).tolist()
    assert not np.array_equal(np.load(samples.cache / "e0-documents.npy"), np.load(samples.cache / "e1-documents.npy"))
    x, y = samples.read([5, 2], 0)
    assert x.shape == y.shape == (2, L) and x.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    np.testing.assert_array_equal(x[0].numpy(), samples.sample(5, 0)[:-1])


def test_the_index_is_cached_memory_mapped_and_rebuilt_when_damaged(corpus, tmp_path):
    shards, _ = corpus
    first = PackedSamples(shards, 8, seed=3, cache_dir=tmp_path / "cache")
    files = sorted(first.cache.glob("e0-*.npy"))
    assert len(files) == 4 and all(oct(f.stat().st_mode)[-3:] in ("600", "644", "664") for f in files)
    times = {f: f.stat().st_mtime_ns for f in files}
    again = PackedSamples(shards, 8, seed=3, cache_dir=tmp_path / "cache")
    assert isinstance(again.order(0), FileRows)  # read as sliced, never mapped
    assert {f: f.stat().st_mtime_ns for f in files} == times  # read, not rebuilt
    want = first.order(0).tolist()
    shuffle = first.cache / "e0-shuffle.npy"
    shuffle.write_bytes(shuffle.read_bytes()[:-16])  # truncated: rebuilt, not trusted
    rebuilt = PackedSamples(shards, 8, seed=3, cache_dir=tmp_path / "cache")
    assert rebuilt.order(0).tolist() == want
    assert not list(first.cache.glob("*.tmp")) and not list(first.cache.glob(".*"))
    other_seed = PackedSamples(shards, 8, seed=4, cache_dir=tmp_path / "cache")
    assert other_seed.cache != first.cache and other_seed.order(0).tolist() != want


def test_validation_samples_are_in_corpus_order(corpus, tmp_path):
    shards, documents = corpus
    val = PackedSamples(shards, 8, seed=3, cache_dir=tmp_path / "c", shuffle=False, name="val")
    stream = np.concatenate(documents)
    assert val.order(0).tolist() == list(range(len(val)))
    np.testing.assert_array_equal(val.sample(2, 0), stream[16:25])
    assert PackedSamples(shards, 8, seed=9, cache_dir=tmp_path / "c", shuffle=False, name="val").cache == val.cache


def test_too_little_text_is_a_one_line_error(tmp_path):
    with IndexedWriter(tmp_path / "tiny", np.uint16) as w:
        w.add_document([[1, 2, 3, EOD]])
        w.finalize()
    with pytest.raises(DataError, match="fewer than 9 tokens: one sample needs seq_len \\+ 1 = 9"):
        PackedSamples([IndexedDataset(tmp_path / "tiny")], 8, 0, tmp_path / "c")


def rows_of(batch, samples, epoch):
    """The sample rows a micro-batch holds (each row's inputs are unique in these corpora)."""
    lookup = {tuple(samples.sample(r, epoch)[:-1].tolist()): r for r in range(len(samples))}
    return [lookup[tuple(x.tolist())] for x in batch[0]]


def test_replicas_take_disjoint_strided_shares_and_resume_in_step(corpus, tmp_path):
    shards, _ = corpus
    samples = PackedSamples(shards, 4, seed=1, cache_dir=tmp_path / "c")
    n, dp, mbs = len(samples), 2, 3
    order = samples.order(0).tolist()
    seen = []
    for rank in range(dp):
        mb = MicroBatches(samples, mbs, dp_rank=rank, dp_size=dp)
        assert mb.batches_per_epoch == (n // dp) // mbs
        got = [r for _ in range(2) for r in rows_of(next(mb), samples, 0)]
        assert got == order[rank::dp][: 2 * mbs]
        seen.append(set(got))
    assert not seen[0] & seen[1]
    reference = MicroBatches(samples, mbs, dp_rank=1, dp_size=dp, seed=1)
    expected = [next(reference) for _ in range(3 * reference.batches_per_epoch)]  # crosses two epochs
    for stop in (0, 1, reference.batches_per_epoch, reference.batches_per_epoch + 1):
        first = MicroBatches(samples, mbs, dp_rank=1, dp_size=dp, seed=1)
        for _ in range(stop):
            next(first)
        resumed = MicroBatches(samples, mbs, dp_rank=1, dp_size=dp, seed=1)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        for want in expected[stop:]:
            got = next(resumed)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def step_rows(samples, layout, steps, start=None):
    """The set of sample rows each step reads on ``layout`` = (dp, micro_batch, microbatches), over every
    replica, optionally resumed from the saved data state ``start`` = (saved state dict, saved dp)."""
    dp, mbs, m = layout
    replicas = [MicroBatches(samples, mbs, dp_rank=r, dp_size=dp) for r in range(dp)]
    if start is not None:
        for rep in replicas:
            state, _ = data_position(start[0], rep, dp)
            rep.load_state_dict(state)
    out = []
    for _ in range(steps):
        out.append(sorted(r for rep in replicas for _ in range(m) for r in rows_of(next(rep), samples, rep.epoch)))
    return out, replicas


def test_resume_at_another_layout_reads_the_same_samples_per_step(corpus, tmp_path):
    """pp 2 with micro-batch 4 x 2 micro-batches -> dp 2 with 2 x 4 (the same global batch of 8): every
    step after the resume reads exactly the samples the uninterrupted run reads."""
    shards, _ = corpus
    samples = PackedSamples(shards, 2, seed=7, cache_dir=tmp_path / "c")
    uninterrupted, _ = step_rows(samples, (1, 4, 2), 6)
    first, replicas = step_rows(samples, (1, 4, 2), 3)
    assert first == uninterrupted[:3]
    saved = data_state(replicas[0], 1)
    assert saved["samples"] == 3 * 8
    resumed, _ = step_rows(samples, (2, 2, 2), 3, start=(json.loads(json.dumps(saved)), 1))
    assert resumed == uninterrupted[3:]


def test_synthetic_samples_are_seeded_and_hold_out_the_last_rows():
    train, val = SyntheticSamples.split(50, 16, seed=0, tokens=17 * 10, holdout=3)
    assert len(train) == 7 and len(val) == 3
    again, _ = SyntheticSamples.split(50, 16, seed=0, tokens=17 * 10, holdout=3)
    whole, _ = SyntheticSamples.split(50, 16, seed=0, tokens=17 * 10, holdout=0)
    assert torch.equal(train.ids, again.ids) and torch.equal(torch.cat([train.ids, val.ids]), whole.ids)
    other, _ = SyntheticSamples.split(50, 16, seed=1, tokens=17 * 10, holdout=0)
    assert not torch.equal(whole.ids, other.ids) and int(whole.ids.max()) < 50
    mb = MicroBatches(train, 2, holdout=3, validation=val)
    held = list(mb.held_out())
    assert len(held) == 1 and torch.equal(held[0][0], val.ids[val.order(0)[:2].tolist(), :-1])
    with pytest.raises(DataError, match="fewer than the 4 held-out sequences"):
        MicroBatches(train, 2, holdout=4, validation=val)
    with pytest.raises(DataError, match="too few for dp_size=2 x micro_batch_size=4"):
        MicroBatches(train, 4, dp_rank=0, dp_size=2)


def test_blend_shares_stay_within_one_percent_and_the_stream_is_a_prefix():
    corpus, number = assignment([0.7, 0.2, 0.1], 60_000)
    for start in range(0, 50_000, 3_331):
        shares = np.bincount(corpus[start : start + 10_000], minlength=3) / 10_000
        assert np.abs(shares - [0.7, 0.2, 0.1]).max() <= 0.01, (start, shares)
    for c in range(3):  # each corpus's samples are taken in order, none skipped
        assert number[corpus == c].tolist() == list(range(int((corpus == c).sum())))
    shorter = assignment([0.7, 0.2, 0.1], 10_000)
    assert np.array_equal(shorter[0], corpus[:10_000]) and np.array_equal(shorter[1], number[:10_000])


def test_a_blend_reads_each_corpus_in_its_own_order_and_restarts_an_exhausted_one(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = PackedSamples(write_corpus(tmp_path / "a", 1, 30, seed=1, base=1)[0], 4, 0, tmp_path / "ca")
    b = PackedSamples(write_corpus(tmp_path / "b", 1, 3, seed=2, base=1000)[0], 4, 0, tmp_path / "cb")
    said = []
    blend = BlendedSamples([(0.5, a), (0.5, b)], total=4 * len(b), cache_dir=tmp_path / "cache",
                           names=["a", "b"], log=said.append)
    rows = list(range(len(blend)))
    x, _ = blend.read(rows, 0)
    shares = np.bincount([int(blend.locate(r, 0)[0]) for r in rows], minlength=2) / len(rows)
    assert abs(shares[0] - 0.5) <= 1 / len(rows) + 1e-9
    for r in rows[:20]:
        c, e, row = blend.locate(r, 0)
        part = (a, b)[c]
        assert torch.equal(x[r], torch.from_numpy(part.sample(row, e)[:-1]))
    assert [line for line in said if "b is exhausted" in line] == [said[0]] and len(said) == 1
    assert "starts epoch 1 (reshuffled)" in said[0]
    again = BlendedSamples([(0.5, a), (0.5, b)], total=4 * len(b), cache_dir=tmp_path / "cache")
    assert torch.equal(again.read(rows[:8], 0)[0], x[:8])
    assert os.path.isdir(tmp_path / "cache" / "blend")
