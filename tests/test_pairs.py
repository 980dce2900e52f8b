"""BERT pairs from memory-mapped sentence shards: segments against a per-document reference, every
row against the corpus it came from, NSP and masking shares, determinism, the caches, the errors."""
import os

import numpy as np
import pytest
import torch

from mp_toolkit.data import pairs
from mp_toolkit.data.indexed import IndexedDataset, IndexedWriter
from mp_toolkit.data.mlm import IGNORE_INDEX, IS_NEXT, NOT_NEXT, SpecialIds
from mp_toolkit.data.pairs import PairSamples, index_key, truncate_pair
from mp_toolkit.data.rows import FileRows
from mp_toolkit.errors import DataError

SPECIAL = SpecialIds(pad=0, cls=1, sep=2, mask=3)
BASE, PER_DOC = 4, 10  # token id of sentence s of document d: BASE + d * PER_DOC + s
SEQ = 32
NEVER = (4,)  # document 0's first sentence: an ordinary id that must never be masked nor drawn



def _truncate(la: int, lb: int, budget: int) -> tuple[int, int]:
    """The reference: trim the longer side one token at a time until A + B fit (A loses its front, B its end)."""
    while la + lb > budget:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return la, lb

def corpus_docs(seed=0, n_docs=20):
    """Documents of 3-10 sentences of 1-12 tokens each, every token naming its (document, sentence),
    but document 3's first sentence and document 5's second longer than a pair's budget; then a
    one-sentence document (never an A) and an empty one."""
    rng = np.random.default_rng(seed)
    docs = [[np.full(rng.integers(1, 13), BASE + d * PER_DOC + s) for s in range(rng.integers(3, 11))]
            for d in range(n_docs)]
    docs[3][0], docs[5][1] = np.full(40, BASE + 3 * PER_DOC), np.full(35, BASE + 5 * PER_DOC + 1)
    return docs + [[np.full(5, BASE + n_docs * PER_DOC)], []]


def write(prefix, docs, dtype=np.uint16):
    with IndexedWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc)
        w.finalize()
    return IndexedDataset(prefix)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(docs, two shards): documents 0-9 in the first, the rest in the second."""
    root = tmp_path_factory.mktemp("pairs-corpus")
    docs = corpus_docs()
    return docs, [write(root / "a", docs[:10]), write(root / "b", docs[10:])]


VOCAB = BASE + 21 * PER_DOC


def make(shards, cache, **kw):
    args = dict(special=SPECIAL, vocab_size=VOCAB, never_mask=NEVER, seq_len=SEQ, seed=0, cache_dir=cache)
    return PairSamples(shards, **{**args, **kw})


@pytest.fixture(scope="module")
def samples(corpus, tmp_path_factory):
    return make(corpus[1], tmp_path_factory.mktemp("pairs-cache"))


def reference_segments(docs, budget):
    """The segmenting rule written per document with plain loops: [(doc, first, end)] sentence numbers."""
    out = []
    for d, doc in enumerate(docs):
        lens = [len(s) for s in doc]
        windows = [sum(lens[:i]) // budget for i in range(len(lens))]
        groups = []
        for i, w in enumerate(windows):
            if i and w == windows[i - 1]:
                groups[-1][1] = i + 1
            else:
                groups.append([i, i + 1])
        merged = []
        for g in groups:  # a lone sentence joins the group before it
            if g[1] - g[0] == 1 and merged:
                merged[-1][1] = g[1]
            else:
                merged.append(g)
        if len(merged) > 1 and merged[0][1] - merged[0][0] == 1:  # ... a lone first one the group after it
            head = merged.pop(0)
            merged[0][0] = head[0]
        out += [(d, f, e) for f, e in merged if e - f >= 2]
    return out


def global_number(docs):
    """(document, sentence) -> the sentence's number across the shards (they hold the documents in order)."""
    starts = np.concatenate(([0], np.cumsum([len(d) for d in docs])))
    return lambda d, s: int(starts[d] + s)


@pytest.mark.parametrize("chunk", [pairs.CHUNK, 7])
def test_segments_follow_the_rule_whatever_the_chunking(corpus, tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(pairs, "CHUNK", chunk)  # 7: documents of one shard over several build steps
    docs, shards = corpus
    ps = make(shards, tmp_path)
    g = global_number(docs)
    expected = [(0 if d < 10 else 1, g(d, f), g(d, e - 1) + 1) for d, f, e in reference_segments(docs, SEQ - 3)]
    assert [tuple(r[:3]) for r in ps.segments.tolist()] == expected
    assert len(ps) == len(expected) > 20
    with_sentences = [d for d, doc in enumerate(docs) if doc]
    assert ps.documents.tolist() == [[0 if d < 10 else 1, g(d, 0), g(d, 0) + len(docs[d])] for d in with_sentences]
    doc_of_first = {g(d, 0): i for i, d in enumerate(with_sentences)}
    assert all(doc_of_first[int(ps.documents[r[3]][1])] == r[3] and ps.documents[r[3]][1] <= r[1]
               for r in ps.segments.tolist())
    assert g(20, 0) not in ps.segments[:, 1]  # the one-sentence document starts no sample


def decode(tokens):
    """Token ids -> [(document, sentence, count)] runs."""
    runs = []
    for t in tokens.tolist():
        key = divmod(t - BASE, PER_DOC)
        if runs and tuple(runs[-1][:2]) == key:
            runs[-1][2] += 1
        else:
            runs.append([*key, 1])
    return runs


def flat(docs, d, lo, hi):
    return np.concatenate(docs[d][lo:hi]).tolist()


def check_row(docs, segment, ids, types, attention, mlm, nsp, budget=SEQ - 3):
    """One row against the corpus: layout, then A and B exactly as the rule cuts them."""
    orig = np.where(mlm != IGNORE_INDEX, mlm, ids)  # the tokens before masking
    n = int(attention.sum())
    assert attention.tolist() == [1] * n + [0] * (len(ids) - n)
    seps = np.flatnonzero(orig == SPECIAL.sep).tolist()
    assert orig[0] == SPECIAL.cls and len(seps) == 2 and seps[1] == n - 1
    assert (orig[n:] == SPECIAL.pad).all() and not np.isin(orig[1:n], [SPECIAL.cls, SPECIAL.pad]).any()
    assert types.tolist() == [0] * (seps[0] + 1) + [1] * (n - seps[0] - 1) + [0] * (len(ids) - n)
    a, b = orig[1 : seps[0]], orig[seps[0] + 1 : n - 1]
    runs_a, runs_b = decode(a), decode(b)
    d, a_last = runs_a[-1][:2]
    assert {r[0] for r in runs_a} == {d} and [r[1] for r in runs_a] == list(range(runs_a[0][1], a_last + 1))
    first = int(segment[1]) - global_number(docs)(d, 0)  # the segment's first sentence in its document
    a_full = flat(docs, d, first, a_last + 1)
    db, b_first = runs_b[0][:2]
    if nsp == IS_NEXT:
        assert (db, b_first) == (d, a_last + 1)
        end = int(segment[2]) - global_number(docs)(d, 0)
        b_full = flat(docs, d, b_first, end)
    else:
        assert nsp == NOT_NEXT and db != d
        end = b_first + 1
        while end < len(docs[db]) and len(flat(docs, db, b_first, end)) < budget - len(a_full):
            end += 1
        b_full = flat(docs, db, b_first, end)
    na, nb = _truncate(len(a_full), len(b_full), budget)
    assert a.tolist() == a_full[len(a_full) - na :] and b.tolist() == b_full[:nb]


def read_all(ps, epochs):
    out = []
    for epoch in epochs:
        rows = list(range(len(ps)))
        (ids, types, attention), (mlm, nsp) = ps.read(rows, epoch)
        out += [(ps.segments[r], ids[i].numpy(), types[i].numpy(), attention[i].numpy(), mlm[i].numpy(),
                 int(nsp[i])) for i, r in enumerate(rows)]
    return out


def test_every_row_is_a_pair_cut_from_the_corpus_and_the_shares_hold(corpus, samples):
    docs, _ = corpus
    rows = read_all(samples, range(10))
    for row in rows:
        check_row(docs, *row)
    nsp = np.array([r[-1] for r in rows])
    assert abs((nsp == NOT_NEXT).mean() - 0.5) < 0.08, (nsp == NOT_NEXT).mean()
    ids, mlm = np.stack([r[1] for r in rows]), np.stack([r[4] for r in rows])
    orig = np.where(mlm != IGNORE_INDEX, mlm, ids)
    chosen, ordinary = mlm != IGNORE_INDEX, ~np.isin(orig, [0, 1, 2, 3, *NEVER])
    assert not (chosen & ~ordinary).any()  # specials, padding and never_mask are never chosen
    assert abs(chosen.sum() / ordinary.sum() - 0.15) < 0.01
    assert (ids[~chosen] == orig[~chosen]).all()
    as_mask = (ids[chosen] == SPECIAL.mask).mean()
    assert 0.74 < as_mask < 0.86, as_mask
    replaced = ids[chosen & (ids != SPECIAL.mask) & (ids != orig)]
    assert len(replaced) and not np.isin(replaced, [0, 1, 2, 3, *NEVER]).any() and (replaced < VOCAB).all()


@pytest.mark.parametrize("p, label", [(0.0, IS_NEXT), (1.0, NOT_NEXT)])
def test_nsp_probability_zero_and_one(corpus, tmp_path, p, label):
    docs, shards = corpus
    rows = read_all(make(shards, tmp_path, nsp_probability=p), [0, 1])
    assert {r[-1] for r in rows} == {label}
    for row in rows:
        check_row(docs, *row)


def test_a_long_sentence_is_cut_without_losing_the_layout(tmp_path):
    """A 500-token sentence against seq_len 16: A is trimmed to what B leaves, the row fills seq_len."""
    docs = [[np.full(500, 5), np.full(3, 6)], [np.full(4, 7), np.full(2, 8)]]
    ps = PairSamples([write(tmp_path / "c", docs)], SPECIAL, 9, (), 16, 0, tmp_path, nsp_probability=0.0)
    (ids, types, attention), (mlm, _) = ps.read([0], 0)
    orig = torch.where(mlm != IGNORE_INDEX, mlm, ids)[0].tolist()
    assert orig == [1] + [5] * 10 + [2] + [6] * 3 + [2]  # 500 + 3 over a budget of 13: A keeps 10
    assert attention[0].tolist() == [1] * 16 and types[0].tolist() == [0] * 12 + [1] * 4


def test_truncate_pair_is_the_trimming_loop_in_closed_form():
    for budget in range(2, 30):
        for la in range(0, 40):
            for lb in range(0, 40):
                assert truncate_pair(la, lb, budget) == _truncate(la, lb, budget), (la, lb, budget)


def test_a_row_is_the_same_whatever_the_read_order_and_the_instance(corpus, samples):
    rows = [5, 0, 17, 3]
    (ids, types, attention), (mlm, nsp) = samples.read(rows, 2)
    (r_ids, r_types, r_att), (r_mlm, r_nsp) = samples.read(rows[::-1], 2)
    for a, b in ((ids, r_ids), (types, r_types), (attention, r_att), (mlm, r_mlm)):
        assert torch.equal(a, b.flip(0)) and a.dtype == torch.int64 and a.shape == (4, SEQ)
    assert torch.equal(nsp, r_nsp.flip(0)) and nsp.shape == (4,)
    single = samples.read([17], 2)
    assert torch.equal(single[0][0][0], ids[2]) and torch.equal(single[1][0][0], mlm[2])
    assert not torch.equal(samples.read([17], 3)[0][0][0], ids[2])  # another epoch masks (and pairs) anew
    hf = make(corpus[1], samples._stem.parent.parent, hf_order=True).read(rows, 2)
    assert all(torch.equal(x, y) for x, y in zip(hf[0], (ids, attention, types)))
    assert torch.equal(hf[1][0], mlm) and torch.equal(hf[1][1], nsp)


def test_caches_are_reused_by_a_second_instance(corpus, tmp_path):
    first = make(corpus[1], tmp_path)
    order = first.order(0)
    files = sorted((tmp_path / "pairs").iterdir())
    assert [f.name.split("-", 1)[1] for f in files] == ["documents.npy", "order-0-0.npy", "segments.npy"]
    stamps = [f.stat().st_mtime_ns for f in files]
    second = make(corpus[1], tmp_path)
    assert np.array_equal(second.order(0), order)
    assert sorted((tmp_path / "pairs").iterdir()) == files and [f.stat().st_mtime_ns for f in files] == stamps
    assert isinstance(second.segments, np.memmap) and isinstance(second.order(0), FileRows)  # order: read by pread
    a, b = first.read([1, 2], 4), second.read([1, 2], 4)
    assert all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))
    assert make(corpus[1], tmp_path, seq_len=SEQ + 1)._stem != second._stem  # seq_len keys the index


def test_order_is_a_cached_permutation_per_epoch(samples):
    e0, e1 = samples.order(0), samples.order(1)
    assert e0.dtype == np.int64 and sorted(e0.tolist()) == list(range(len(samples)))
    assert sorted(e1.tolist()) == list(range(len(samples))) and not np.array_equal(e0, e1)
    assert np.array_equal(samples.order(0), e0)


@pytest.mark.parametrize("name", ["segments", "documents", "order-0-0"])
def test_a_truncated_cache_file_is_rebuilt(corpus, tmp_path, name):
    ps = make(corpus[1], tmp_path)
    order, segments = np.asarray(ps.order(0)), ps.segments.copy()
    path = ps._path(name)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 40)
    again = make(corpus[1], tmp_path)
    assert np.array_equal(again.order(0), order) and np.array_equal(again.segments, segments)
    assert path.stat().st_size == size


def test_a_cache_file_appears_only_whole(corpus, tmp_path, monkeypatch):
    """The file is written in full under another name in the same folder, then renamed; a failed
    rename leaves neither the file nor its temporary."""
    ps = make(corpus[1], tmp_path)
    target, seen = ps._path("order-0-5"), []

    def failing_replace(src, dst):
        seen.append((np.load(src).copy(), os.path.dirname(src), os.path.exists(dst)))
        raise OSError("disk went away")

    monkeypatch.setattr(pairs.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk went away"):
        ps.order(5)
    monkeypatch.undo()
    (written, folder, existed), = seen
    assert folder == str(target.parent) and not existed and sorted(written.tolist()) == list(range(len(ps)))
    assert not target.exists() and not any(p.suffix == ".tmp" for p in target.parent.iterdir())
    assert np.array_equal(ps.order(5), written)


def test_a_rewritten_shard_gets_a_new_index(tmp_path):
    docs = corpus_docs(seed=1)
    shard = write(tmp_path / "s", docs)
    key = index_key([shard], SEQ)
    assert index_key([IndexedDataset(tmp_path / "s")], SEQ) == key
    shard = write(tmp_path / "s", docs[:12])
    assert index_key([shard], SEQ) != key
    assert len(make([shard], tmp_path / "cache")) == len(reference_segments(docs[:12], SEQ - 3))


def test_bucket_length_is_the_smallest_bucket_holding_the_longest_pair(samples):
    rows = [0, 1, 2]
    inputs, _ = samples.read(rows, 0)
    longest = int(inputs[2].sum(dim=1).max())
    expected = next(b for b in (8, 16, 24, SEQ) if b >= longest)
    assert samples.bucket_length(rows, 0, inputs, (8, 16, 24, SEQ)) == expected


@pytest.mark.parametrize("docs, kw, message", [
    ([[np.full(3, 5), np.full(2, 6)], [], []], {}, "1 document"),
    ([[np.full(3, 5)], [np.full(2, 6)], [np.full(2, 7)]], {}, "need at least two sentences"),
    (None, {"seq_len": 4}, "seq_len=4"),
    (None, {"nsp_probability": 1.5}, "nsp_probability=1.5"),
    (None, {"nsp_probability": -0.1}, "nsp_probability=-0.1"),
    (None, {"mlm_probability": 0.0}, "mlm_probability=0.0"),
    (None, {"mlm_probability": 1.0}, "mlm_probability=1.0"),
])
def test_errors_are_one_line(tmp_path, docs, kw, message):
    shard = write(tmp_path / "e", docs if docs is not None else corpus_docs())
    with pytest.raises(DataError, match=message) as err:
        make([shard], tmp_path / "cache", **kw)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "cache" / "pairs").exists() or not any((tmp_path / "cache" / "pairs").iterdir())


def test_shards_of_different_dtypes_and_no_shards_are_refused(corpus, tmp_path):
    wide = write(tmp_path / "wide", corpus_docs(), dtype=np.int32)
    with pytest.raises(DataError, match="int32 tokens but .* holds uint16"):
        make([corpus[1][0], wide], tmp_path)
    with pytest.raises(DataError, match="no shards"):
        make([], tmp_path)
