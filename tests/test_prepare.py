"""`mpt data prepare / merge / verify` (`mp_toolkit.data.prepare`): what it writes opens with
`PreparedCorpus.open` and holds each document's own encoding, in order, split between train and val;
every input format reads the same documents; a killed run continues without encoding again; parts
merge into what one run writes; bad input is one line, exit 2, and leaves no manifest."""

import fcntl
import gzip
import json
import os
import random
import subprocess
import sys

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from mp_toolkit.cli import main
from mp_toolkit.cli_args import build_parser
from mp_toolkit.data.corpus import stdlib_files
from mp_toolkit.data.prepare import (
    DEFAULT_CHUNK_DOCS,
    DEFAULT_SAMPLE_BYTES,
    prepare,
    sentences_of,
)
from mp_toolkit.data.prepared import PreparedCorpus
from mp_toolkit.data.sources import Source, expand
from mp_toolkit.data.tokens import SPECIAL_TOKENS
from tests.cli_helpers import assert_one_line_exit_2

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud fire water "
         "light north south").split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    """n distinct documents of 1-3 lines, each line one to three sentences."""
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))).capitalize() + rng.choice(".!?")

    return [f"Doc {i}: " + "\n".join(" ".join(sentence() for _ in range(rng.randint(1, 3)))
                                      for _ in range(rng.randint(1, 3))) for i in range(n)]


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return path


def wordpiece(path, texts) -> str:
    """A tiny BERT WordPiece tokenizer.json trained on ``texts`` (its end-of-document id is [SEP])."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    tok.save(str(path))
    return str(path)


def documents(shards) -> list[list[list[int]]]:
    """Every document of ``shards`` in order, as its sequences' token lists."""
    return [[ds[s].tolist() for s in ds.document(d)] for ds in shards for d in range(ds.num_documents)]


def encode(tokenizer_file, text) -> list[int]:
    return Tokenizer.from_file(str(tokenizer_file)).encode(text, add_special_tokens=False).ids


def run_ok(capsys, *argv) -> str:
    code = main(["data", *map(str, argv)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.strip()


def test_prepare_stores_each_documents_encoding_in_order_split_by_document(tmp_path, capsys):
    texts = make_texts(60)
    src = write_jsonl(tmp_path / "a.jsonl", texts[:50])
    (tmp_path / "more").mkdir()
    for i, t in enumerate(texts[50:]):  # a directory of text files, one document each, read in name order
        (tmp_path / "more" / f"{i:02d}.txt").write_text(t)
    out = tmp_path / "out"
    line = run_ok(capsys, "prepare", "--input", src, tmp_path / "more", "--output", out, "--vocab-size", 300,
                  "--workers", 1, "--chunk-docs", 7, "--val-fraction", 0.25, "--no-progress")
    corpus = PreparedCorpus.open(out)
    tok = out / "tokenizer.json"
    assert corpus.vocab_size == 300 and corpus.eod_id == 0 and corpus.dtype == np.uint16
    assert Tokenizer.from_file(str(tok)).token_to_id("<|endoftext|>") == 0
    expected = {tuple(encode(tok, t) + [0]): i for i, t in enumerate(texts)}
    assert len(expected) == 60
    index = {split: [expected[tuple(seqs[0])] for seqs in documents(getattr(corpus, split))]
             for split in ("train", "val")}
    for split, found in index.items():
        assert found == sorted(found), split  # documents in order across shards
        assert all(len(seqs) == 1 for seqs in documents(getattr(corpus, split)))
    assert not set(index["train"]) & set(index["val"]) and sorted(index["train"] + index["val"]) == list(range(60))
    assert 5 <= len(index["val"]) <= 25  # 0.25 of 60 = 15
    # chunks of 7 documents of file 0 (50 documents: 8 chunks), then one per text file
    names = sorted({ds.prefix.rsplit("/", 1)[1] for ds in corpus.train + corpus.val})
    assert names[:8] == [f"f00000-c{c:05d}" for c in range(8)] and names[8:] == [f"f{k:05d}-c00000"
                                                                                  for k in range(1, 11)]
    totals = corpus.manifest["totals"]
    assert totals["train"]["documents"] == len(index["train"]) and totals["val"]["documents"] == len(index["val"])
    assert corpus.manifest["command"].startswith("mpt data prepare --input")
    assert corpus.manifest["inputs"][0] == {"path": str(src), "bytes": src.stat().st_size}
    assert line.startswith(f"prepared {out}: train {len(index['train'])} documents") and "1 workers" in line


def test_workers_encode_a_given_wordpiece_tokenizer_as_one_process_does(tmp_path, capsys):
    texts = make_texts(40)
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    tok = wordpiece(tmp_path / "wp.json", texts)
    for workers in (1, 2):
        run_ok(capsys, "prepare", "--input", src, "--output", tmp_path / f"w{workers}", "--tokenizer", tok,
               "--workers", workers, "--chunk-docs", 9, "--val-fraction", 0.2)
    one, two = (PreparedCorpus.open(tmp_path / f"w{w}") for w in (1, 2))
    assert one.manifest["splits"] == two.manifest["splits"]  # the same shards, byte for byte (sha256)
    sep = Tokenizer.from_file(tok).token_to_id("[SEP]")
    assert two.eod_id == sep and two.vocab_size == Tokenizer.from_file(tok).get_vocab_size()
    got = sorted(documents(two.train) + documents(two.val))
    assert got == sorted([[encode(tok, t) + [sep]] for t in texts])
    assert (tmp_path / "w2" / "tokenizer.json").read_bytes() == open(tok, "rb").read()


def test_split_sentences_stores_each_documents_sentences(tmp_path, capsys):
    texts = make_texts(30) + ["   \n\t\n", "First one. Second (two) here!\n\n  Third line  \nfourth. lower stays."]
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    out = tmp_path / "out"
    line = run_ok(capsys, "prepare", "--input", src, "--output", out, "--vocab-size", 300, "--split-sentences")
    corpus = PreparedCorpus.open(out)
    full = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert [full.token_to_id(t) for t in SPECIAL_TOKENS] == [296, 297, 298, 299] and corpus.vocab_size == 300
    assert corpus.split_sentences and corpus.manifest["append_eod"] is False
    assert sentences_of(texts[-1]) == ["First one.", "Second (two) here!", "Third line", "fourth. lower stays."]
    docs = documents(corpus.train)
    assert len(docs) == 31 and "1 documents without a sentence skipped" in line  # the blank document
    expect = [[encode(out / "tokenizer.json", s) for s in sentences_of(t)] for t in texts if t.strip()]
    assert docs == expect and sum(map(len, docs)) > 31


def test_every_input_format_reads_the_same_documents(tmp_path, capsys):
    texts = make_texts(12)
    plain = write_jsonl(tmp_path / "a.jsonl", texts, key="content")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(plain.read_text())
    table = datasets.Dataset.from_dict({"content": texts, "n": list(range(12))})
    table.to_parquet(str(tmp_path / "c.parquet"))
    table.save_to_disk(str(tmp_path / "d_saved"))
    arrow = tmp_path / "e.arrow"
    arrow.write_bytes(next((tmp_path / "d_saved").glob("*.arrow")).read_bytes())
    tok = wordpiece(tmp_path / "wp.json", texts)
    inputs = [plain, tmp_path / "b.jsonl.gz", tmp_path / "c.parquet", tmp_path / "d_saved", arrow]
    run_ok(capsys, "prepare", "--input", *inputs, "--output", tmp_path / "out", "--tokenizer", tok,
           "--json-keys", "content", "--no-append-eod")
    corpus = PreparedCorpus.open(tmp_path / "out")
    assert [ds.prefix.rsplit("/", 1)[1] for ds in corpus.train] == [f"f{k:05d}-c00000" for k in range(5)]
    assert documents(corpus.train) == [[encode(tok, t)] for t in texts] * 5
    assert corpus.manifest["json_keys"] == ["content"] and corpus.manifest["append_eod"] is False


def test_a_killed_run_continues_without_encoding_finished_chunks_again(tmp_path, capsys):
    texts = make_texts(23)
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    out = tmp_path / "out"
    argv = ["prepare", "--input", src, "--output", out, "--vocab-size", 300, "--chunk-docs", 5, "--val-fraction",
            0.3, "--seed", 7]
    run_ok(capsys, *argv)
    first = json.loads((out / "manifest.json").read_text())
    bins = sorted((out / "train").glob("*.bin"))
    assert len(bins) == 5
    mtimes = {p: p.stat().st_mtime_ns for p in bins}
    # as if killed while writing the last chunk: no manifest, no record, a stale half shard
    (out / "manifest.json").unlink()
    (out / "chunks" / "f00000-c00004.json").unlink()
    (out / "train" / "f00000-c00004.idx").unlink()
    (out / "train" / "f00000-c00004.bin.partial").write_bytes(b"\x01" * 3)
    with pytest.raises(Exception, match="did not finish"):
        PreparedCorpus.open(out)
    line = run_ok(capsys, *argv)
    assert "1 chunks encoded, 4 done before" in line
    again = json.loads((out / "manifest.json").read_text())
    assert again["splits"] == first["splits"] and again["totals"] == first["totals"]
    assert {p: p.stat().st_mtime_ns for p in bins[:4]} == {p: mtimes[p] for p in bins[:4]}  # not rewritten
    assert not list(out.rglob("*.partial"))
    line = run_ok(capsys, *argv)  # finished: nothing to do
    assert "0 chunks encoded, 0 done before" in line and json.loads((out / "manifest.json").read_text()) == again


def test_parts_merge_into_what_one_run_writes(tmp_path, capsys):
    texts = make_texts(30)
    files = [write_jsonl(tmp_path / f"{k}.jsonl", texts[10 * k: 10 * k + 10]) for k in range(3)]
    (tmp_path / "hf").mkdir()
    wordpiece(tmp_path / "hf" / "tokenizer.json", texts)
    common = ["--tokenizer", tmp_path / "hf", "--val-fraction", 0.2, "--chunk-docs", 4]  # an HF directory
    run_ok(capsys, "prepare", "--input", *files, "--output", tmp_path / "one", *common)
    for i in (1, 0):
        line = run_ok(capsys, "prepare", "--input", *files, "--output", tmp_path / "parts", *common, "--shard",
                      f"{i}/2")
        assert line.startswith(f"prepared part {i} of 2 of")
    assert not (tmp_path / "parts" / "manifest.json").exists()
    run_ok(capsys, "merge", tmp_path / "parts")
    one, merged = (PreparedCorpus.open(tmp_path / d) for d in ("one", "parts"))
    assert merged.manifest["splits"] == one.manifest["splits"] and merged.manifest["totals"] == one.manifest["totals"]
    assert documents(merged.train) == documents(one.train)
    (tmp_path / "parts" / "manifest.part-1-of-2.json").unlink()
    assert "lacks manifest.part-1-of-2.json" in assert_one_line_exit_2(capsys, ["data", "merge", tmp_path / "parts"])


def test_val_min_docs_holds_out_at_least_that_many_when_the_fraction_gives_fewer(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", make_texts(12))
    few = prepare([src], tmp_path / "few", vocab_size=300, val_fraction=0.01, val_min_docs=3).manifest
    assert few["totals"]["val"]["documents"] == 3 and few["val_fraction"] == 3 / 12
    enough = prepare([src], tmp_path / "enough", vocab_size=300, val_fraction=0.5, val_min_docs=1).manifest
    plain = prepare([src], tmp_path / "plain", vocab_size=300, val_fraction=0.5).manifest
    assert enough["totals"] == plain["totals"] and enough["totals"]["val"]["documents"] > 1  # the fraction decides


def test_val_docs_holds_out_exactly_that_many_documents(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", make_texts(40))
    done = prepare([src], tmp_path / "out", vocab_size=300, val_docs=6, chunk_docs=8, seed=3)
    corpus = PreparedCorpus.open(done.path)
    assert done.path == tmp_path / "out" and corpus.manifest["totals"]["val"]["documents"] == 6
    assert corpus.manifest["totals"]["train"]["documents"] == 34 and corpus.manifest["val_fraction"] == 6 / 40


def test_the_tokenizer_trains_on_a_seeded_sample_of_whole_documents(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", make_texts(40))
    trained = {}
    for name, seed, budget in (("a", 0, 400), ("b", 0, 400), ("c", 1, 400), ("all", 0, 10**6)):
        prepare([src], tmp_path / name, vocab_size=300, seed=seed, sample_bytes=budget)
        trained[name] = (tmp_path / name / "tokenizer.json").read_bytes()
    assert trained["a"] == trained["b"]  # the same seed, the same sample
    assert len({trained["a"], trained["c"], trained["all"]}) == 3


def test_verify_finds_an_edited_byte(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", make_texts(10))
    out = tmp_path / "out"
    prepare([src], out, vocab_size=300)
    assert run_ok(capsys, "verify", out).startswith(f"OK {out}: train 1 shards, 10 documents")
    data = out / "train" / "f00000-c00000.bin"
    raw = bytearray(data.read_bytes())
    raw[11] ^= 1
    data.write_bytes(bytes(raw))
    assert "sha256" in assert_one_line_exit_2(capsys, ["data", "verify", out], mentions=str(data))


def test_a_second_run_of_a_locked_or_differently_prepared_dir_is_refused(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", make_texts(10))
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        line = assert_one_line_exit_2(capsys, ["data", "prepare", "--input", src, "--output", out, "--vocab-size",
                                               300])
        assert f"{out} is being prepared by process 4242" in line
    prepare([src], out, vocab_size=300, seed=1)
    line = assert_one_line_exit_2(capsys, ["data", "prepare", "--input", src, "--output", out, "--vocab-size", 300,
                                           "--seed", 2])
    assert "other settings: seed 1 there, 2 here" in line
    settings = json.loads((out / "prepare.json").read_text())
    del settings["val_min_docs"]  # a directory prepared before the setting existed: its default, and it continues
    (out / "prepare.json").write_text(json.dumps(settings))
    assert prepare([src], out, vocab_size=300, seed=1).path == out
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert_one_line_exit_2(capsys, ["data", "prepare", "--input", src, "--output", tmp_path / "other", "--vocab-size",
                                    300], mentions="is not empty")


def bad_inputs(tmp_path) -> list[tuple[list, str]]:
    """(argv after ``data prepare --output DIR``, what the one line says) for each kind of bad input."""
    good = write_jsonl(tmp_path / "good.jsonl", make_texts(5))
    (tmp_path / "notjson.jsonl").write_text('{"text": "a"}\n{"text": oops}\n')
    (tmp_path / "nokey.jsonl").write_text('{"text": "a"}\n\n{"body": "b"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 ok".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    (tmp_path / "bad_tok.json").write_text('{"model": 3}')
    (tmp_path / "noeod.json").write_text(Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]")).to_str())
    tok = ["--vocab-size", "300"]
    cases = [
        (["--input", tmp_path / "missing.txt", *tok], "missing.txt does not exist"),
        (["--input", tmp_path / "notjson.jsonl", *tok], "notjson.jsonl:2 is not a JSON line"),
        (["--input", tmp_path / "nokey.jsonl", *tok], "nokey.jsonl:3 has no string 'text' field"),
        (["--input", tmp_path / "latin1.txt", *tok], "latin1.txt is not UTF-8: byte 3 is 0xe9"),
        (["--input", tmp_path / "latin1.jsonl", *tok], "latin1.jsonl:2 is not UTF-8: byte 27 is 0xe9"),
        (["--input", tmp_path / "empty.jsonl", *tok], "hold no documents"),
        (["--input", tmp_path / "broken.jsonl.gz", *tok], "cannot read"),
        (["--input", good, "--tokenizer", tmp_path / "bad_tok.json"], "cannot read tokenizer"),
        (["--input", good, "--tokenizer", tmp_path / "nope"], "does not exist"),
        (["--input", good, "--vocab-size", "100"], "--vocab-size 100 is too small"),
        (["--input", good, "--vocab-size", "244", "--split-sentences"], "use at least 248"),
        (["--input", good, *tok, "--shard", "2/2"], "--shard '2/2' is not i/n"),
        (["--input", good, *tok, "--shard", "x"], "--shard 'x' is not i/n"),
        (["--input", good, *tok, "--shard", "0/2"], "needs --tokenizer"),
        (["--input", good, *tok, "--val-fraction", "1.5"], "--val-fraction 1.5"),
        (["--input", good, *tok, "--val-docs", "5"], "leaves no training document"),
        (["--input", good, "--tokenizer", tmp_path / "noeod.json", "--append-eod"], "has none of <|endoftext|>"),
        (["--input", good, *tok, "--json-keys", "a", "b"], "give one key"),
        (["--input", good, "--tokenizer", tmp_path / "noeod.json", *tok], "not allowed with argument"),
        (["--input", good, "--tokenizer", tmp_path / "noeod.json", "--split-sentences"],
         "lacks [PAD], [CLS], [SEP], [MASK], which BERT's sentence pairs need"),
        (["--input", good, *tok, "--val-docs", "1", "--val-min-docs", "1"], "--val-min-docs 1"),
    ]
    try:
        import zstandard  # noqa: F401 -- with it installed the .zst case reads a truncated frame instead
        cases.append((["--input", tmp_path / "a.jsonl.zst", *tok], "cannot read"))
    except ImportError:
        cases.append((["--input", tmp_path / "a.jsonl.zst", *tok], "pip install zstandard"))
    return cases


def test_bad_input_is_one_line_exit_2_and_no_manifest(tmp_path, capsys):
    for n, (argv, says) in enumerate(bad_inputs(tmp_path)):
        out = tmp_path / f"out{n}"
        assert_one_line_exit_2(capsys, ["data", "prepare", "--output", out, *argv], mentions=says)
        assert not (out / "manifest.json").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_file_is_one_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", make_texts(3))
    src.chmod(0)
    assert_one_line_exit_2(capsys, ["data", "prepare", "--input", src, "--output", tmp_path / "o", "--vocab-size",
                                    300], mentions="Permission denied")


def test_a_directory_is_searched_in_path_order_a_saved_dataset_as_one_input(tmp_path):
    tree = tmp_path / "tree"
    datasets.Dataset.from_dict({"text": ["x"]}).save_to_disk(str(tree / "b" / "saved"))
    for name in ("b/a.txt", "a/z.jsonl.gz", "a/notes.csv", ".git/x.txt", "c.parquet", "out/manifest.json"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(b"")
    found = expand([tree], exclude=tree / "out")
    assert [(s.path.relative_to(tree).as_posix(), s.kind, s.compression) for s in found] == [
        ("a/z.jsonl.gz", "jsonl", ".gz"), ("b/a.txt", "text", None), ("b/saved", "saved", None),
        ("c.parquet", "parquet", None)]


def test_stdlib_input_and_its_non_utf8_files(tmp_path):
    assert [s.path for s in expand(["stdlib"])] == stdlib_files()
    latin = tmp_path / "old.py"
    latin.write_bytes(b"# caf\xe9\n")
    assert list(Source(latin, "text", latin.stat().st_size, skip_non_utf8=True).documents("text")) == [(None, 7)]


def test_the_data_parser_imports_nothing_heavy():
    code = ("import sys\n"
            "from mp_toolkit.cli_args import build_parser\n"
            "build_parser().parse_args(['data', 'prepare', '--input', 'x', '--output', 'y', '--vocab-size', '300'])\n"
            "print([m for m in ('torch', 'numpy', 'datasets', 'tokenizers') if m in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_help_states_the_defaults_prepare_uses():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["data"]
    prep = next(a for a in sub._actions if a.dest == "data_command").choices["prepare"]
    helps = {a.dest: a.help for a in prep._actions}
    assert f"(default {DEFAULT_CHUNK_DOCS:,})" in helps["chunk_docs"]
    assert f"(default {DEFAULT_SAMPLE_BYTES:,})" in helps["tokenizer_sample_bytes"]
