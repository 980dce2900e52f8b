"""`mpt train --data` on what is not prepared yet: the stdlib corpus, our byte-level BPE, text files
prepared once into the cache (`mp_toolkit.data.feed`) and read from it on every later start."""
import json
import os
import sysconfig
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from mp_toolkit.data.corpus import stdlib_files
from mp_toolkit.data.feed import AUTO_VAL_FRACTION, Wanted, feed, source_key
from mp_toolkit.data.prepared import PreparedCorpus
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


def test_stdlib_files_are_bounded_sorted_python_sources():
    files = stdlib_files()
    assert len(files) > 100
    assert all(p.suffix == ".py" for p in files)
    assert files == stdlib_files()  # deterministic
    assert sum(p.stat().st_size for p in files) <= 12 * 1024 * 1024
    for p in files:
        assert not {"site-packages", "dist-packages", "test", "tests", "idlelib"} & set(p.parts[-4:-1])


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

    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))[:20]]
    tok = train_tokenizer(texts, 256)
    assert tok.get_vocab_size() == 256 and tok.token_to_id("<|endoftext|>") == 0
    sample = "caf\u00e9 \u2603 \U0001d11e \x00\x7f unseen " + EVERY_UTF8_BYTE
    assert tok.decode(tok.encode(sample).ids) == sample
    assert train_tokenizer(texts, MIN_VOCAB).get_vocab_size() == MIN_VOCAB  # no merges
    with pytest.raises(DataError, match=f"vocab_size={MIN_VOCAB - 1} is too small .* at least {MIN_VOCAB}"):
        train_tokenizer(texts, MIN_VOCAB - 1)


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




def test_an_unprepared_source_is_prepared_once_into_the_cache_and_read_from_it(corpus, tmp_path):
    """--data FILE/DIR runs `mpt data prepare` into <cache>/prepared/<key> on the first start (a byte-level
    BPE with the model's vocabulary, AUTO_VAL_FRACTION of the documents held out); a later start opens it
    without preparing; touching a file gives another key, so changed text is prepared again."""
    wanted = Wanted(vocab_size=300, seq_len=16, seed=0)
    said = []
    (corpus / "latin1.txt").unlink()  # a non-UTF-8 file in a user's corpus is an error (stdlib skips them)
    fed = feed(str(corpus), wanted, tmp_path / "cache", total=64, log=said.append)
    assert len(said) == 1 and "data: preparing" in said[0]
    (prepared,) = (tmp_path / "cache" / "prepared").iterdir()
    assert prepared.name == source_key(str(corpus), wanted, None)
    corpus_ = PreparedCorpus.open(prepared)
    assert corpus_.vocab_size == 300 and corpus_.manifest["val_fraction"] in (AUTO_VAL_FRACTION, 1 / 27)
    assert fed.digest and fed.tokenizer_digest == corpus_.manifest["tokenizer"]["sha256"]
    x, y = fed.train.read([0, 1], 0)
    assert x.shape == (2, 16) and int(x.max()) < 300 and torch.equal(x[:, 1:], y[:, :-1])
    again = []
    fed2 = feed(str(corpus), wanted, tmp_path / "cache", total=64, log=again.append)
    assert again == [] and fed2.digest == fed.digest
    assert torch.equal(fed2.train.read([0, 1], 0)[0], x)
    doc = corpus / "doc00.txt"
    doc.write_text(doc.read_text() + "more text\n")
    assert source_key(str(corpus), wanted, None) != prepared.name


def test_bad_sources_are_one_line_errors(tmp_path):
    wanted = Wanted(vocab_size=300, seq_len=16, seed=0)
    with pytest.raises(DataError, match="nowhere: no such file or directory"):
        feed(str(tmp_path / "nowhere"), wanted, tmp_path / "cache", total=8)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError) as e:
        feed(str(empty), wanted, tmp_path / "cache", total=8)
    assert "\n" not in str(e.value) and "empty.txt" in str(e.value)
    with pytest.raises(DataError, match="blend weight 'x' is not a positive number"):
        feed(f"x:{empty},1:{empty}", wanted, tmp_path / "cache", total=8)


def test_a_source_of_few_documents_still_holds_one_out(tmp_path):
    """5% of five documents is most likely none: an automatically prepared source holds out at least one."""
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text(f"document {i}\n" + "words and more words\n" * 40)
    fed = feed(str(tmp_path), Wanted(vocab_size=300, seq_len=16, seed=0), tmp_path / "cache", total=8)
    totals = fed.corpora[0].manifest["totals"]
    assert totals["val"]["documents"] == 1 and totals["train"]["documents"] == 4
    assert fed.validation is not None and len(fed.validation) > 0
