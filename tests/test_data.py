"""Packed LM data: corpus reading, cached BPE, deterministic datasets, sharded micro-batches."""
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from mp_toolkit.data.corpus import read_texts, stdlib_files
from mp_toolkit.data.lm import MicroBatches, build_lm_dataset
from mp_toolkit.data.tokens import MIN_VOCAB, byte_alphabet, progress_bars_on, train_tokenizer
from mp_toolkit.errors import DataError
from tests.mpt_command import run_mpt

torch.set_num_threads(1)
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega def return import class self").split()


@pytest.fixture
def corpus(tmp_path):
    """A few hundred KB of pseudo-text in every supported format, plus one latin-1 file."""
    rng = np.random.default_rng(0)

    def doc(n):
        return " ".join(rng.choice(WORDS, size=n)) + "\n"

    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i in range(20):
        (root / f"doc{i:02d}.txt").write_text(doc(800))
    (root / "sub" / "notes.md").write_text("# title\n" + doc(500))
    (root / "sub" / "code.py").write_text("def f(x):\n    return x\n" + doc(500))
    (root / "sub" / "records.jsonl").write_text(
        "\n".join(json.dumps({"text": doc(300), "id": i}) for i in range(5)) + "\n\n"
    )
    (root / "sub" / "ignored.csv").write_text("a,b\n")  # not a corpus suffix: skipped in a directory
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    return root


def build(corpus, tmp_path, seed=0, seq_len=32, cache="cache"):
    return build_lm_dataset(corpus, vocab_size=300, seq_len=seq_len, seed=seed, cache_dir=tmp_path / cache)


def numbered_dataset(n, seq_len):
    """Row i holds i*(seq_len+1) ... so a row's identity is its first token // (seq_len+1)."""
    ids = np.arange(n * (seq_len + 1), dtype=np.int64).reshape(n, seq_len + 1)
    return datasets.Dataset.from_dict({"input_ids": ids}).with_format("torch")


def row_ids(x, seq_len):
    return (x[:, 0] // (seq_len + 1)).tolist()


def test_stdlib_files_are_bounded_sorted_python_sources():
    files = stdlib_files()
    assert len(files) > 100
    assert all(p.suffix == ".py" for p in files)
    assert files == stdlib_files()  # deterministic
    assert sum(p.stat().st_size for p in files) <= 12 * 1024 * 1024
    for p in files:
        assert not {"site-packages", "dist-packages", "test", "tests", "idlelib"} & set(p.parts[-4:-1])


def test_stdlib_texts_skip_exactly_the_non_utf8_files():
    files = stdlib_files()
    texts, skipped = read_texts(files)
    not_utf8 = []
    for p in files:
        try:
            p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            not_utf8.append(p)
    assert skipped == not_utf8  # possibly empty: this interpreter may ship none
    assert len(texts) > 100 and any("def " in t for t in texts)


def test_read_texts_formats_and_non_utf8(corpus):
    texts, skipped = read_texts([corpus])
    assert skipped == [corpus / "latin1.txt"]
    assert len(texts) == 20 + 1 + 1 + 5  # txt files, md, py, jsonl records
    assert any(t.startswith("# title") for t in texts)
    assert not any("a,b" in t for t in texts)
    single, _ = read_texts([corpus / "sub" / "records.jsonl"])
    assert len(single) == 5


def test_read_texts_errors_name_the_path(tmp_path, corpus):
    with pytest.raises(DataError, match=r"corpus path .*missing\.txt does not exist"):
        read_texts([tmp_path / "missing.txt"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(DataError, match=r'bad\.jsonl:2 has no string "text" field'):
        read_texts([bad])
    with pytest.raises(DataError, match=r"ignored\.csv has suffix '\.csv'"):
        read_texts([corpus / "sub" / "ignored.csv"])
    assert issubclass(DataError, ValueError)


def test_tokenizer_is_cached_and_deterministic(corpus, tmp_path, monkeypatch):
    texts, _ = read_texts([corpus])
    tok = train_tokenizer(texts, 300, tmp_path / "c1")
    cached = list((tmp_path / "c1").glob("tokenizer-*.json"))
    assert len(cached) == 1 and len(cached[0].stem) == len("tokenizer-") + 16
    assert tok.get_vocab_size() == 300 and tok.token_to_id("<|endoftext|>") == 0

    # A second call must load the file, not train: make training impossible.
    monkeypatch.setattr("mp_toolkit.data.tokens.trainers.BpeTrainer", None)
    again = train_tokenizer(texts, 300, tmp_path / "c1")
    sample = texts[:3] + ["caf\u00e9 \u2603 unseen bytes"]
    assert [e.ids for e in again.encode_batch(sample)] == [e.ids for e in tok.encode_batch(sample)]
    assert again.decode(again.encode(sample[-1]).ids) == sample[-1]  # byte-level: lossless
    monkeypatch.undo()

    fresh = train_tokenizer(texts, 300, tmp_path / "c2")  # trained again elsewhere
    assert fresh.to_str() == tok.to_str()
    train_tokenizer(texts, 280, tmp_path / "c1")  # another vocab size is another cache entry
    assert len(list((tmp_path / "c1").glob("tokenizer-*.json"))) == 2
    with pytest.raises(DataError, match="vocab_size=100 is too small"):
        train_tokenizer(texts, 100, tmp_path / "c1")


# one character for every byte that can lead a UTF-8 sequence (0x00-0x7F, C2-DF, E0-EF, F0-F4) and every
# continuation byte (80-BF): the UTF-8 encoding of any string uses these bytes and no others
EVERY_UTF8_BYTE = "".join(map(chr, [*range(0x800), 0x800, *range(0x1000, 0x10000, 0x1000), 0x10000, 0x40000, 0x80000,
                                    0xC0000, 0x100000]))


def test_a_vocabulary_under_257_keeps_the_bytes_utf8_uses(corpus, tmp_path):
    """gpt-tiny's 256 ids cannot hold 256 byte symbols and <|endoftext|>: the 13 bytes UTF-8 never
    uses (C0, C1, F5-FF) are left out, and every string still encodes, losslessly."""
    assert sorted({b for ch in EVERY_UTF8_BYTE for b in ch.encode()}) == [
        *range(0xC0), *range(0xC2, 0xF5)]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    used = {c for piece, _ in byte_level.pre_tokenize_str(EVERY_UTF8_BYTE) for c in piece}
    assert len(byte_alphabet(256)) == 243 == MIN_VOCAB - 1 and set(byte_alphabet(256)) == used
    assert sorted(byte_alphabet(257)) == sorted(pre_tokenizers.ByteLevel.alphabet())  # 257 up: unchanged

    texts, _ = read_texts([corpus])
    tok = train_tokenizer(texts, 256, tmp_path / "cache")
    assert tok.get_vocab_size() == 256 and tok.token_to_id("<|endoftext|>") == 0
    sample = "caf\u00e9 \u2603 \U0001d11e \x00\x7f unseen " + EVERY_UTF8_BYTE
    assert tok.decode(tok.encode(sample).ids) == sample
    assert train_tokenizer(texts, MIN_VOCAB, tmp_path / "cache").get_vocab_size() == MIN_VOCAB  # no merges
    with pytest.raises(DataError, match=f"vocab_size={MIN_VOCAB - 1} is too small .* at least {MIN_VOCAB}"):
        train_tokenizer(texts, MIN_VOCAB - 1, tmp_path / "cache")


def test_gpt_tiny_trains_on_text(tmp_path):
    """The smallest preset trains on a trained tokenizer (its vocab_size is 256), at its own 64
    positions where no --seq-len is given (the default 128 exceeds them). Shrunk from the defaults:
    --data one stdlib package (the whole stdlib takes ~25 s of CPU to tokenize), one step on one stage."""
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "json"
    r = run_mpt(["train", "--model", "gpt-tiny", "--pp", "1", "--steps", "1", "--data", corpus,
                 "--cache-dir", tmp_path / "cache", "--threads", "1", "--no-progress"],
                env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "model gpt-tiny" in r.stdout and "over 1 steps" in r.stdout
    assert "--seq-len 64: the model's positions (the default, 128, exceeds them)" in r.stdout


def test_dataset_is_the_packed_token_stream(corpus, tmp_path):
    ds = build(corpus, tmp_path, seq_len=32)
    assert ds.column_names == ["input_ids"]
    rows = ds[:]["input_ids"]
    assert rows.dtype == torch.int64 and rows.shape[1] == 33
    texts, _ = read_texts([corpus])
    tok = train_tokenizer(texts, 300, tmp_path / "cache")
    stream = [t for enc in tok.encode_batch(texts) for t in enc.ids + [0]]  # eos after each doc
    n = len(stream) // 33
    expected = torch.tensor(stream[: n * 33]).view(n, 33)
    assert len(ds) == n
    # Shuffled, but exactly the contiguous chunks.
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, expected.tolist()))
    assert not torch.equal(rows, expected)


def test_dataset_deterministic_per_seed(corpus, tmp_path):
    a = build(corpus, tmp_path, seed=0)[:]["input_ids"]
    b = build(corpus, tmp_path, seed=0, cache="other-cache")[:]["input_ids"]
    c = build(corpus, tmp_path, seed=1)[:]["input_ids"]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert sorted(map(tuple, a.tolist())) == sorted(map(tuple, c.tolist()))


def test_dataset_is_bit_identical_in_another_process(corpus, tmp_path):
    ours = build(corpus, tmp_path)[:]["input_ids"].numpy().tobytes()
    script = (
        "import hashlib, sys; from mp_toolkit.data.lm import build_lm_dataset; "
        "ds = build_lm_dataset(sys.argv[1], 300, 32, 0, sys.argv[2]); "
        "print(hashlib.sha256(ds[:]['input_ids'].numpy().tobytes()).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", script, str(corpus), str(tmp_path / "proc-cache")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hashlib.sha256(ours).hexdigest()


def test_micro_batches_shapes_and_label_shift(corpus, tmp_path):
    ds = build(corpus, tmp_path, seq_len=32)
    batches = MicroBatches(ds, micro_batch_size=4)
    x, y = next(batches)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    torch.testing.assert_close(y[:, :-1], x[:, 1:])
    rows = ds[:]["input_ids"]
    torch.testing.assert_close(x, rows[:4, :-1])  # epoch 0 keeps the dataset's (shuffled) order
    torch.testing.assert_close(y, rows[:4, 1:])
    assert batches.position == 1


def test_dp_shards_are_disjoint_and_equal_sized():
    ds, L = numbered_dataset(50, 7), 7
    seen = []
    for rank in range(3):
        mb = MicroBatches(ds, micro_batch_size=4, dp_rank=rank, dp_size=3)
        assert mb.batches_per_epoch == 4  # 50 // 3 = 16 sequences each
        rows = [r for _ in range(4) for r in row_ids(next(mb)[0], L)]
        assert rows == [rank + 3 * k for k in range(16)]  # rank r takes r, r + dp_size, ...
        seen.append(set(rows))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    with pytest.raises(DataError, match=r"dp_rank=3 must be in \[0, dp_size=3\)"):
        MicroBatches(ds, 4, dp_rank=3, dp_size=3)
    with pytest.raises(DataError, match="too small for dp_size=3 x micro_batch_size=32"):
        MicroBatches(ds, 32, dp_rank=0, dp_size=3)


def test_epochs_reshuffle_with_seed_plus_epoch():
    ds, L = numbered_dataset(12, 3), 3
    mb = MicroBatches(ds, micro_batch_size=4, seed=5)
    epochs = [[r for _ in range(3) for r in row_ids(next(mb)[0], L)] for _ in range(3)]
    assert epochs[0] == list(range(12))
    assert sorted(epochs[1]) == sorted(epochs[2]) == list(range(12))
    assert epochs[1] != epochs[0] and epochs[1] != epochs[2]
    assert epochs[1] == torch.randperm(12, generator=torch.Generator().manual_seed(6)).tolist()
    assert mb.state_dict() == {"epoch": 2, "position": 9}


def test_state_dict_resume_continues_identically():
    ds = numbered_dataset(30, 5)
    reference = MicroBatches(ds, micro_batch_size=4, dp_rank=1, dp_size=2, seed=3)
    expected = [next(reference) for _ in range(12)]  # 3 batches per epoch: crosses 3 epochs
    for stop in (0, 2, 3, 7):
        first = MicroBatches(ds, micro_batch_size=4, dp_rank=1, dp_size=2, seed=3)
        for _ in range(stop):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON manifest
        resumed = MicroBatches(ds, micro_batch_size=4, dp_rank=1, dp_size=2, seed=3)
        resumed.load_state_dict(state)
        assert resumed.position == stop
        for want in expected[stop:]:
            got = next(resumed)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(DataError, match="epoch=0 position=9 does not fit 3 micro-batches per epoch"):
        resumed.load_state_dict({"epoch": 0, "position": 9})


def test_synthetic_needs_no_tokenizer_and_is_seeded():
    a = build_lm_dataset("synthetic", vocab_size=50, seq_len=16, seed=0, cache_dir=None)
    assert len(a) == 4096 and a[:]["input_ids"].shape == (4096, 17)
    assert int(a[:]["input_ids"].min()) >= 0 and int(a[:]["input_ids"].max()) == 49
    b = build_lm_dataset("synthetic", 50, 16, 0, None)
    c = build_lm_dataset("synthetic", 50, 16, 1, None)
    assert torch.equal(a[:]["input_ids"], b[:]["input_ids"])
    assert not torch.equal(a[:]["input_ids"], c[:]["input_ids"])
    small = build_lm_dataset("synthetic", 50, 16, 0, None, synthetic_tokens=17 * 10 + 5)
    assert len(small) == 10
    x, y = next(MicroBatches(small, 2))
    torch.testing.assert_close(y[:, :-1], x[:, 1:])


def test_build_errors(tmp_path):
    with pytest.raises(DataError, match=r"corpus path .*nowhere does not exist"):
        build_lm_dataset(tmp_path / "nowhere", 300, 16, 0, tmp_path / "cache")
    with pytest.raises(DataError, match="needs a cache_dir"):
        build_lm_dataset("stdlib", 300, 16, 0, None)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("just a few words")
    with pytest.raises(DataError, match="fewer than one sequence of 1025"):
        build_lm_dataset(tiny, 300, 1024, 0, tmp_path / "cache")


def test_stdlib_dataset_small_vocab(tmp_path, monkeypatch):
    # The real stdlib files, capped at 3 MB: the full 12 MB corpus costs ~15 s of BPE training and
    # encoding on an idle 2-core machine (several times that on a busy one), and runs the same code.
    full = stdlib_files()
    monkeypatch.setattr("mp_toolkit.data.corpus.STDLIB_MAX_BYTES", 3 * 1024 * 1024)
    capped = stdlib_files()
    assert 50 < len(capped) < len(full) and capped == full[: len(capped)]
    ds = build_lm_dataset("stdlib", vocab_size=512, seq_len=64, seed=0, cache_dir=tmp_path / "cache")
    rows = ds[:]["input_ids"]
    assert rows.shape[1] == 65 and len(ds) > 5_000
    assert int(rows.max()) < 512 and int((rows == 0).sum()) > 50  # eos between documents
    tok = train_tokenizer(read_texts(capped)[0], 512, tmp_path / "cache")  # loads the cached file
    decoded = tok.decode(rows[:50].flatten().tolist())  # shuffled 64-token snippets of Python
    assert "def " in decoded and "self" in decoded
    again = build_lm_dataset("stdlib", vocab_size=512, seq_len=64, seed=0, cache_dir=tmp_path / "cache")
    assert torch.equal(again[:]["input_ids"], rows)


def test_progressprogress_bars_only_on_a_terminal(monkeypatch):
    """Tokenizer training, corpus encoding and `mpt plan`'s layer timing draw a tqdm bar on a terminal,
    after DELAY_S seconds; elsewhere (tests, pipes, --no-progress) they iterate the plain list."""
    from tqdm import tqdm

    from mp_toolkit import progress as bars

    items = [1, 2, 3]
    assert bars.progress(items, "x") is items  # pytest's stderr is not a terminal
    monkeypatch.setattr(bars.sys.stderr, "isatty", lambda: True, raising=False)
    bar = bars.progress(items, "encoding corpus", len(items))
    assert isinstance(bar, tqdm) and bar.delay == bars.DELAY_S and list(bar) == items
    assert bars.progress(items, "x", enabled=False) is items
    datasets.disable_progress_bars()  # what `mpt train --no-progress` does
    try:
        assert not progress_bars_on()
    finally:
        datasets.enable_progress_bars()
    assert progress_bars_on()


def test_caches_are_private_verified_and_rebuilt_when_damaged(corpus, tmp_path):
    """Token and tokenizer caches: 0600, and a truncated, retyped or out-of-range cache is rebuilt
    (never an uncaught error, which --restarts would only repeat)."""
    want = build(corpus, tmp_path)[:]["input_ids"]
    cache = tmp_path / "cache"
    (tokens,), (tokenizer,) = cache.glob("tokens-*.npy"), cache.glob("tokenizer-*.json")
    assert {p.stat().st_mode & 0o777 for p in (tokens, tokenizer)} == {0o600}
    good = tokens.read_bytes()
    damages = {
        "truncated": good[: len(good) // 2],
        "int64": None,  # filled below: the same ids as another dtype
        "out of range": None,  # an id the tokenizer cannot have made
    }
    stream = np.load(tokens)
    for name in damages:
        if name == "truncated":
            tokens.write_bytes(damages[name])
        else:
            bad = (stream.astype(np.int64) if name == "int64"
                   else np.where(np.arange(len(stream)) == 5, 10**6, stream).astype(np.int32))
            with open(tokens, "wb") as f:
                np.save(f, bad)
        assert torch.equal(build(corpus, tmp_path)[:]["input_ids"], want), name
        assert tokens.read_bytes() == good, name  # rebuilt in place
    tokenizer.write_text(tokenizer.read_text()[:100])  # a truncated tokenizer: trained again
    assert torch.equal(build(corpus, tmp_path)[:]["input_ids"], want)
    assert tokenizer.stat().st_mode & 0o777 == 0o600
