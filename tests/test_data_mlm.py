"""BERT pre-training data through the feed: a sentence-split prepared corpus, BERT's vocabulary, MLM masking
proportions, masks as a function of (seed, epoch, row), dp shards and resume (`PairSamples`' own pairing is
tested in tests/test_pairs.py)."""
import numpy as np
import pytest
import torch

from mp_toolkit.data.corpus import stdlib_files
from mp_toolkit.data.feed import Wanted, feed, special_ids
from mp_toolkit.data.lm import MicroBatches
from mp_toolkit.data.mlm import IGNORE_INDEX, SPECIAL_TOKENS, mask_tokens
from mp_toolkit.data.tokens import load_tokenizer_file
from mp_toolkit.errors import DataError

torch.set_num_threads(1)
SEQ = 64


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    """The first 40 standard-library sources (~0.9 MB) prepared with --split-sentences and a 512-id BPE."""
    root = tmp_path_factory.mktemp("mlm")
    (root / "src").mkdir()
    for i, f in enumerate(stdlib_files()[:40]):
        data = f.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        (root / "src" / f"{i:02d}.py").write_bytes(data)
    return feed(str(root / "src"), Wanted(512, SEQ, 0, pairs=True), root / "cache", total=64)


def test_vocabulary_has_the_special_tokens_last(fed):
    s = fed.special
    assert (s.pad, s.cls, s.sep, s.mask) == (508, 509, 510, 511)
    tokenizer, _ = load_tokenizer_file(fed.corpora[0].tokenizer_file)
    assert tokenizer.get_vocab_size() == 512
    assert [tokenizer.id_to_token(i) for i in (s.pad, s.cls, s.sep, s.mask)] == list(SPECIAL_TOKENS)
    assert fed.corpora[0].split_sentences
    assert special_ids(fed.corpora[0], "src")[1] == (0, 508, 509, 510, 511)  # <|endoftext|> of the BPE, BERT's four


def masked_epoch(fed, n_batches=40, mbs=16):
    batches = MicroBatches(fed.train, mbs, seed=0)
    out = [next(batches) for _ in range(min(n_batches, batches.batches_per_epoch))]
    ids = torch.cat([b[0][0] for b in out]).numpy()
    labels = torch.cat([b[1][0] for b in out]).numpy()
    original = np.where(labels != IGNORE_INDEX, labels, ids)
    return original, ids, labels


def test_masking_proportions_15_80_10_10(fed):
    original, ids, labels = masked_epoch(fed)
    never = np.asarray(special_ids(fed.corpora[0], "src")[1])
    candidates = ~np.isin(original, never)
    chosen = labels != IGNORE_INDEX
    # ~640 sequences, ~35k candidate tokens, ~5k chosen: the count per sequence is p * n rounded
    # stochastically (std of the total fraction ~5e-4); the 80/10/10 split is binomial (std < 0.006)
    assert chosen.sum() / candidates.sum() == pytest.approx(0.15, abs=0.004)
    assert (chosen.sum(1) >= 1).all()
    became_mask = (ids == fed.special.mask)[chosen].mean()
    kept = (ids == original)[chosen].mean()
    assert became_mask == pytest.approx(0.8, abs=0.03)
    assert kept == pytest.approx(0.1, abs=0.025)
    assert 1 - became_mask - kept == pytest.approx(0.1, abs=0.025)
    special = np.isin(original, never)
    np.testing.assert_array_equal(ids[special], original[special])
    assert (labels[special] == IGNORE_INDEX).all()


def test_batches_have_the_engine_layout(fed):
    (ids, types, mask), (mlm, nsp) = next(MicroBatches(fed.train, 4))
    for t in (ids, types, mask, mlm):
        assert t.shape == (4, SEQ) and t.dtype == torch.int64 and t.is_contiguous()
    assert nsp.shape == (4,) and nsp.dtype == torch.int64
    assert set(types.unique().tolist()) <= {0, 1} and set(mask.unique().tolist()) <= {0, 1}


def test_a_rows_mask_is_the_same_on_every_dp_layout_and_another_on_another_seed(fed):
    whole = MicroBatches(fed.train, micro_batch_size=8, seed=3)
    shard = MicroBatches(fed.train, micro_batch_size=4, dp_rank=1, dp_size=2, seed=3)
    (a, _, _), (la, _) = next(whole)
    (b, _, _), (lb, _) = next(shard)
    assert torch.equal(b, a[1::2]) and torch.equal(lb, la[1::2])
    rows = [int(r) for r in fed.train.order(0)[:8]]
    other = fed.train.read(rows, 1)  # the same rows in epoch 1: masked afresh
    assert not torch.equal(other[1][0], la)


def test_resume_across_epochs_gives_identical_batches(fed):
    mbs = len(fed.train) // 3  # 3 micro-batches per epoch: 5 batches cross into epoch 1
    it = MicroBatches(fed.train, micro_batch_size=mbs, seed=1)
    for _ in range(2):
        next(it)
    state = it.state_dict()
    expected = [next(it) for _ in range(3)]
    assert it.state_dict() == {"epoch": 1, "position": 5}
    resumed = MicroBatches(fed.train, micro_batch_size=mbs, seed=1)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, [next(resumed) for _ in range(3)]):
        assert all(torch.equal(p, q) for p, q in zip(x + y, rx + ry))


def test_mask_tokens_never_chooses_never_mask_and_is_seeded():
    ids = np.array([1, 5, 6, 7, 8, 9, 10, 2, 0, 0])
    never = np.array([0, 1, 2, 3])
    regular = np.arange(4, 20)
    out, labels = mask_tokens(ids, np.random.default_rng([0, 0, 5]), 3, never, regular)
    again = mask_tokens(ids, np.random.default_rng([0, 0, 5]), 3, never, regular)
    assert np.array_equal(out, again[0]) and np.array_equal(labels, again[1])
    assert (labels[np.isin(ids, never)] == IGNORE_INDEX).all() and (labels != IGNORE_INDEX).sum() >= 1
    np.testing.assert_array_equal(out[np.isin(ids, never)], ids[np.isin(ids, never)])


def test_a_corpus_without_sentences_is_refused_for_bert(tmp_path):
    (tmp_path / "a.txt").write_text("one line only\n")
    (tmp_path / "b.txt").write_text("another single line\n")
    with pytest.raises(DataError, match="sentence"):
        feed(str(tmp_path), Wanted(300, SEQ, 0, pairs=True), tmp_path / "cache", total=8)
