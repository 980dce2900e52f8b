"""A prepared directory read back (`PreparedCorpus.open`): a manifest that disagrees with its files is one
line naming the file, for `mpt train` before any rank starts as for the reader itself."""
import json
import shutil

import pytest

from mp_toolkit.cli import main
from mp_toolkit.data.prepared import MANIFEST, PreparedCorpus, is_prepared
from mp_toolkit.errors import DataError
from tests.cli_helpers import assert_one_line_exit_2


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared_dir")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"document {i} " + "some words here and there " * (5 + i % 7)}) + "\n")
    assert main(["data", "prepare", "--input", str(root / "docs.jsonl"), "--output", str(root / "ok"),
                 "--vocab-size", "256", "--val-fraction", "0.2", "--workers", "1", "--no-progress"]) == 0
    return root / "ok"


def damaged(prepared, tmp_path, edit):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    edit(copy, json.loads((copy / MANIFEST).read_text()))
    return copy


def write_manifest(directory, doc):
    (directory / MANIFEST).write_text(json.dumps(doc))


def test_a_prepared_directory_opens_with_its_counts(prepared):
    corpus = PreparedCorpus.open(prepared)
    totals = corpus.manifest["totals"]
    assert sum(ds.num_documents for ds in corpus.train) == totals["train"]["documents"]
    assert sum(ds.num_documents for ds in corpus.val) == totals["val"]["documents"] > 0
    assert corpus.tokens("train") == totals["train"]["tokens"] and corpus.vocab_size == 256
    assert corpus.eod_id == 0 and str(corpus.dtype) == "uint16" and is_prepared(prepared)
    assert PreparedCorpus.open(prepared).digest == corpus.digest


def shard_of(doc, split="train"):
    return doc["splits"][split][0]


EDITS = {
    "a shard's .bin is shorter than recorded": (
        lambda d, doc: (d / (shard_of(doc)["prefix"] + ".bin")).write_bytes(
            (d / (shard_of(doc)["prefix"] + ".bin")).read_bytes()[:-2]), "changed after preparing"),
    "a shard is missing": (lambda d, doc: (d / (shard_of(doc)["prefix"] + ".idx")).unlink(), "does not exist"),
    "the counts were edited": (
        lambda d, doc: write_manifest(d, {**doc, "splits": {**doc["splits"], "train": [
            {**shard_of(doc), "documents": shard_of(doc)["documents"] + 1}]}}), "documents"),
    "the tokenizer was replaced": (
        lambda d, doc: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text().replace("}", " }", 1)),
        "the tokenizer was replaced"),
    "another format": (lambda d, doc: write_manifest(d, {**doc, "format": "other"}), "is not a mp_toolkit.prepared"),
    "another version": (lambda d, doc: write_manifest(d, {**doc, "version": 99}), "version 99"),
    "not JSON": (lambda d, doc: (d / MANIFEST).write_text("{not json"), "cannot read"),
    "no training shards": (lambda d, doc: write_manifest(d, {**doc, "splits": {"train": [], "val": []}}),
                           "lists no training shards"),
    "a key is missing": (lambda d, doc: write_manifest(d, {k: v for k, v in doc.items() if k != "dtype"}), "lacks"),
    "no manifest": (lambda d, doc: (d / MANIFEST).unlink(), "did not finish"),
}


@pytest.mark.parametrize("what", list(EDITS))
def test_a_manifest_that_disagrees_with_its_files_is_one_line(prepared, tmp_path, capsys, what):
    edit, says = EDITS[what]
    copy = damaged(prepared, tmp_path, edit)
    with pytest.raises(DataError) as e:
        PreparedCorpus.open(copy)
    assert says in str(e.value) and "\n" not in str(e.value) and str(copy) in str(e.value), str(e.value)
    if what != "no manifest":  # without a manifest the folder is a corpus of raw files to prepare
        assert_one_line_exit_2(capsys, ["train", "--model", "gpt-tiny", "--data", copy, "--pp", "1", "--steps", "1"],
                               mentions=says)


def test_bert_on_a_corpus_prepared_without_sentences_is_one_line(prepared, capsys):
    assert_one_line_exit_2(capsys, ["train", "--model", "bert-tiny", "--data", prepared, "--pp", "1", "--steps", "1",
                                    "--seq-len", "32"], mentions="without --split-sentences")
