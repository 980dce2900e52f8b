"""BERT pre-training data: packing, NSP pairs, MLM masking proportions, determinism, resume, DP shards."""
import numpy as np
import pytest
import torch

from mp_toolkit.data.corpus import read_texts, stdlib_files
from mp_toolkit.data.mlm import (
    IGNORE_INDEX,
    IS_NEXT,
    NOT_NEXT,
    MLMMicroBatches,
    build_mlm_corpus,
    mask_tokens,
)
from mp_toolkit.errors import DataError

torch.set_num_threads(1)
SEQ = 64


@pytest.fixture(scope="module")
def texts():
    """The first 40 standard-library sources (~0.9 MB): 40 documents of code and docstrings."""
    texts, _ = read_texts(stdlib_files()[:40])
    return texts


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mlm-cache")


@pytest.fixture(scope="module")
def corpus(texts, cache):
    return build_mlm_corpus(texts, vocab_size=512, seq_len=SEQ, seed=0, cache_dir=cache)


def rows(corpus, idx=None):
    return corpus.dataset[list(range(len(corpus.dataset))) if idx is None else list(idx)]


def test_vocabulary_has_the_special_tokens_last(corpus):
    s = corpus.special
    assert corpus.vocab_size == 512
    assert (s.pad, s.cls, s.sep, s.mask) == (508, 509, 510, 511)
    names = [corpus.tokenizer.id_to_token(i) for i in (s.pad, s.cls, s.sep, s.mask)]
    assert names == ["[PAD]", "[CLS]", "[SEP]", "[MASK]"]
    assert corpus.never_mask == (0, 508, 509, 510, 511)  # <|endoftext|> of the BPE, then BERT's four


def test_pairs_are_packed_cls_a_sep_b_sep_with_types_and_mask(corpus):
    r = rows(corpus)
    ids, types, mask = r["input_ids"], r["token_type_ids"], r["attention_mask"]
    s = corpus.special
    assert ids.shape == types.shape == mask.shape == (len(corpus.dataset), SEQ)
    assert (ids[:, 0] == s.cls).all()
    seps = ids == s.sep
    assert (seps.sum(1) == 2).all()
    first = seps.argmax(1)
    second = SEQ - 1 - seps[:, ::-1].argmax(1)
    pos = np.arange(SEQ)
    assert (first >= 2).all() and (second >= first + 2).all()  # A and B hold at least one token each
    np.testing.assert_array_equal(mask, (pos <= second[:, None]).astype(mask.dtype))
    np.testing.assert_array_equal(types, ((pos > first[:, None]) & (pos <= second[:, None])).astype(types.dtype))
    np.testing.assert_array_equal(ids == s.pad, pos > second[:, None])
    assert (second == SEQ - 1).mean() > 0.5  # most pairs fill the sequence


def test_true_next_b_follows_a_and_random_b_is_another_document(corpus, texts):
    r = rows(corpus)
    label = r["next_sentence_label"]
    nxt = label == IS_NEXT
    assert set(np.unique(label)) == {IS_NEXT, NOT_NEXT}
    assert (r["doc_b"][nxt] == r["doc_a"][nxt]).all() and (r["b_start"][nxt] == r["a_end"][nxt]).all()
    assert (r["doc_b"][~nxt] != r["doc_a"][~nxt]).all()
    assert len(np.unique(r["doc_b"][~nxt])) > 20  # random documents are spread over the corpus

    def tokens(doc, start, end):
        lines = [line.strip() for line in texts[doc].splitlines() if line.strip()][start:end]
        return [t for enc in corpus.tokenizer.encode_batch(lines) for t in enc.ids]

    for i in range(0, len(corpus.dataset), 37):  # ~180 rows: A is a suffix, B a prefix of their sentences
        ids = r["input_ids"][i].tolist()
        first = ids.index(corpus.special.sep)
        second = first + 1 + ids[first + 1:].index(corpus.special.sep)
        a, b = ids[1:first], ids[first + 1:second]
        full_a = tokens(r["doc_a"][i], r["a_start"][i], r["a_end"][i])
        full_b = tokens(r["doc_b"][i], r["b_start"][i], r["b_end"][i])
        assert full_a[len(full_a) - len(a):] == a and full_b[:len(b)] == b, i


def test_nsp_labels_are_half_random(corpus):
    assert len(corpus.dataset) > 5000
    assert rows(corpus)["next_sentence_label"].mean() == pytest.approx(0.5, abs=0.03)  # 5 sigma at n > 5000


@pytest.mark.parametrize("p, expected", [(0.0, IS_NEXT), (1.0, NOT_NEXT)])
def test_nsp_probability_extremes(texts, cache, p, expected):
    c = build_mlm_corpus(texts[:10], vocab_size=512, seq_len=SEQ, seed=0, cache_dir=cache, nsp_probability=p)
    assert (rows(c)["next_sentence_label"] == expected).all()


def masked_epoch(corpus, n_batches=3, mbs=1000, seed=0):
    it = MLMMicroBatches(corpus, micro_batch_size=mbs, seed=seed)
    out = [next(it) for _ in range(n_batches)]
    original = rows(corpus, it.indices(0)[: n_batches * mbs])["input_ids"]
    ids = torch.cat([b[0][0] for b in out]).numpy()
    labels = torch.cat([b[1][0] for b in out]).numpy()
    return original, ids, labels


def test_masking_proportions_15_80_10_10(corpus):
    original, ids, labels = masked_epoch(corpus)
    candidates = ~np.isin(original, corpus.never_mask)
    chosen = labels != IGNORE_INDEX
    # 3000 sequences, ~180k candidate tokens, ~27k chosen. The chosen count per sequence is p * n
    # rounded stochastically (std of the total fraction ~2e-4); the 80/10/10 split is binomial
    # over the chosen tokens (std < 0.003).
    assert chosen.sum() / candidates.sum() == pytest.approx(0.15, abs=0.002)
    assert (chosen.sum(1) >= 1).all()
    became_mask = (ids == corpus.special.mask)[chosen].mean()
    kept = (ids == original)[chosen].mean()
    randomized = 1 - became_mask - kept
    assert became_mask == pytest.approx(0.8, abs=0.015)
    assert kept == pytest.approx(0.1, abs=0.01)  # + ~0.02% random draws that hit the original
    assert randomized == pytest.approx(0.1, abs=0.01)
    np.testing.assert_array_equal(labels[chosen], original[chosen])


def test_special_tokens_and_padding_are_never_masked(corpus):
    original, ids, labels = masked_epoch(corpus, n_batches=1)
    special = np.isin(original, corpus.never_mask)
    np.testing.assert_array_equal(ids[special], original[special])
    assert (labels[special] == IGNORE_INDEX).all()
    # [MASK] and other special ids appear only where a label was set (masked) or were there before
    assert ((ids == corpus.special.mask) <= (labels != IGNORE_INDEX)).all()
    assert not np.isin(ids[labels != IGNORE_INDEX], [corpus.special.pad, corpus.special.cls, corpus.special.sep]).any()


def test_batches_have_the_engine_layout(corpus):
    (ids, types, mask), (mlm, nsp) = next(MLMMicroBatches(corpus, micro_batch_size=4))
    for t in (ids, types, mask, mlm):
        assert t.shape == (4, SEQ) and t.dtype == torch.int64 and t.is_contiguous()
    assert nsp.shape == (4,) and nsp.dtype == torch.int64
    assert set(types.unique().tolist()) <= {0, 1} and set(mask.unique().tolist()) <= {0, 1}


def test_mask_is_a_function_of_seed_epoch_and_index(corpus):
    """The same example gets the same mask whatever the batch or data-parallel layout."""
    whole = MLMMicroBatches(corpus, micro_batch_size=8, seed=3)
    shard = MLMMicroBatches(corpus, micro_batch_size=4, dp_rank=1, dp_size=2, seed=3)
    (a, _, _), (la, _) = next(whole)  # examples 0..7 of epoch 0
    (b, _, _), (lb, _) = next(shard)  # examples 1, 3, 5, 7
    assert shard.indices(0)[:4] == whole.indices(0)[1:8:2]
    torch.testing.assert_close(b, a[1::2], rtol=0, atol=0)
    torch.testing.assert_close(lb, la[1::2], rtol=0, atol=0)
    other_seed = MLMMicroBatches(corpus, micro_batch_size=8, seed=4)
    assert not torch.equal(next(other_seed)[1][0], la)


def test_masks_change_between_epochs(corpus):
    rng = lambda epoch: np.random.default_rng([0, epoch, 5])
    ids = rows(corpus, [5])["input_ids"][0]
    never = np.asarray(corpus.never_mask)
    regular = np.setdiff1d(np.arange(corpus.vocab_size), never)
    e0 = mask_tokens(ids, rng(0), corpus.special.mask, never, regular)
    e0_again = mask_tokens(ids, rng(0), corpus.special.mask, never, regular)
    e1 = mask_tokens(ids, rng(1), corpus.special.mask, never, regular)
    np.testing.assert_array_equal(e0[1], e0_again[1])
    assert not np.array_equal(e0[1], e1[1])


def test_resume_from_state_dict_gives_identical_batches_across_epochs(corpus):
    mbs = len(corpus.dataset) // 3  # 3 micro-batches per epoch, so 5 batches cross into epoch 1
    it = MLMMicroBatches(corpus, micro_batch_size=mbs, seed=1)
    for _ in range(2):
        next(it)
    state = it.state_dict()
    expected = [next(it) for _ in range(3)]
    assert it.state_dict() == {"epoch": 1, "position": 5}
    resumed = MLMMicroBatches(corpus, micro_batch_size=mbs, seed=1)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, [next(resumed) for _ in range(3)]):
        for a, b in zip(x + y, rx + ry):
            assert torch.equal(a, b)
    assert it.indices(1) != it.indices(0)  # epoch 1 is reshuffled


def test_dp_shards_are_disjoint_and_equal_sized(corpus):
    shards = [MLMMicroBatches(corpus, micro_batch_size=16, dp_rank=r, dp_size=3, seed=2) for r in range(3)]
    for epoch in (0, 1):
        idx = [set(s.indices(epoch)) for s in shards]
        assert len({len(i) for i in idx}) == 1 and len(idx[0]) == len(corpus.dataset) // 3 // 16 * 16
        assert not (idx[0] & idx[1]) and not (idx[0] & idx[2]) and not (idx[1] & idx[2])
    for s in shards:  # what a rank yields is the rows it claims
        _, (_, nsp) = next(s)
        np.testing.assert_array_equal(nsp.numpy(), rows(corpus, s.indices(0)[:16])["next_sentence_label"])


def test_same_arguments_build_the_same_corpus(texts, cache, corpus):
    again = build_mlm_corpus(texts, vocab_size=512, seq_len=SEQ, seed=0, cache_dir=cache)
    np.testing.assert_array_equal(rows(again)["input_ids"], rows(corpus)["input_ids"])
    other = build_mlm_corpus(texts, vocab_size=512, seq_len=SEQ, seed=1, cache_dir=cache)
    assert not np.array_equal(rows(other)["next_sentence_label"], rows(corpus)["next_sentence_label"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=247), "vocab_size=247 is too small .* at least 248"),  # 243 UTF-8 bytes, <|endoftext|>, 4 specials
    (dict(seq_len=4), "seq_len=4 cannot hold"),
    (dict(nsp_probability=1.5), "nsp_probability=1.5"),
])
def test_bad_arguments_are_one_line_errors(texts, cache, kwargs, message):
    args = dict(vocab_size=512, seq_len=SEQ, seed=0, cache_dir=cache) | kwargs
    with pytest.raises(DataError, match=message):
        build_mlm_corpus(texts[:3], **args)


def test_one_document_cannot_make_random_pairs(cache, texts):
    with pytest.raises(DataError, match="at least 2"):
        build_mlm_corpus([texts[1]], vocab_size=512, seq_len=SEQ, seed=0, cache_dir=cache)


def test_mlm_probability_must_be_a_fraction(corpus):
    with pytest.raises(DataError, match="mlm_probability=0"):
        MLMMicroBatches(corpus, micro_batch_size=4, mlm_probability=0.0)
