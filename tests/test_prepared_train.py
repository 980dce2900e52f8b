"""`mpt train --data DIR` on a prepared corpus: resume at another layout on the same sample stream, a
blend, a resume on other data refused unless --data-changed-ok, a tokenizer too large for the model.

One corpus is prepared once per module (`mpt data prepare`, in-process); the runs are gpt-tiny at
--seq-len 16 on 2 ranks (each a few seconds)."""
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from mp_toolkit.cli import main
from mp_toolkit.data.prepared import PreparedCorpus
from tests.cli_helpers import assert_one_line_exit_2
from tests.mpt_command import run_mpt

pytestmark = pytest.mark.timeout(600)
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega def return import class self").split()
RUN = ["train", "--model", "gpt-tiny", "--seq-len", "16", "--threads", "1", "--no-progress", "--lr", "1e-2",
       "--optimizer", "lamb", "--timeout", "60", "--schedule", "1f1b"]


def write_docs(path, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, size=int(rng.integers(20, 200))))}) + "\n")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared_train")
    write_docs(root / "a.jsonl", 300, 0)
    write_docs(root / "b.jsonl", 200, 1)
    for name, tokenizer in (("a", ["--vocab-size", "256"]), ("b", ["--tokenizer", str(root / "a")])):
        assert main(["data", "prepare", "--input", str(root / f"{name}.jsonl"), "--output", str(root / name),
                     *tokenizer, "--val-fraction", "0.1", "--workers", "1", "--no-progress"]) == 0
    return root


def train(tmp, name, *args):
    metrics = tmp / f"{name}.jsonl"
    r = run_mpt([*RUN, "--metrics", metrics, *args], timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], r.stdout


def test_resume_at_another_layout_continues_the_same_samples(data, tmp_path):
    """pp 2 with micro-batch 4 x 2 micro-batches saves at step 2; dp 2 with 2 x 2 per replica resumes (the
    same global batch of 8): its steps 3-4 read the samples the uninterrupted pp 2 run reads, so their losses differ
    from it by no more than the two layouts' own difference (measured here: the uninterrupted dp 2 run)."""
    d = str(data / "a")
    pp2, out = train(tmp_path, "pp2", "--data", d, "--pp", "2", "--micro-batch", "4", "--microbatches", "2",
                     "--steps", "4", "--save-dir", tmp_path / "ck", "--save-every", "2")
    assert "data: preparing" not in out  # a prepared directory is read as it is
    dp2, _ = train(tmp_path, "dp2", "--data", d, "--pp", "1", "--dp", "2", "--micro-batch", "2",
                   "--microbatches", "2", "--steps", "4")
    resumed, out = train(tmp_path, "resumed", "--data", d, "--pp", "1", "--dp", "2", "--micro-batch", "2",
                         "--microbatches", "2", "--steps", "4", "--save-dir", tmp_path / "ck2",
                         "--resume", tmp_path / "ck" / "step-00000002")
    assert len(resumed) == 2
    floor = max(abs(a - b) for a, b in zip(pp2, dp2))  # the layouts' own difference over four steps
    assert floor < 1e-3  # the same samples: only the order of the sums differs
    for got, want in zip(resumed, pp2[2:]):
        assert abs(got - want) <= 2 * floor + 1e-6, (resumed, pp2, floor)
    manifest = json.loads((tmp_path / "ck" / "step-00000002" / "manifest.json").read_text())
    meta = manifest.get("meta", manifest)
    assert meta["data"]["samples"] == 2 * 8 and meta["data"]["digest"]


def test_resume_on_other_data_is_refused_unless_data_changed_ok(data, tmp_path, capsys):
    train(tmp_path, "a", "--data", str(data / "a"), "--pp", "1", "--steps", "2", "--micro-batch", "2",
          "--save-dir", tmp_path / "ck", "--save-every", "2")
    other = [*RUN, "--data", str(data / "b"), "--pp", "1", "--steps", "3", "--micro-batch", "2",
             "--save-dir", tmp_path / "ck", "--resume", "latest"]
    r = run_mpt(other, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and "was trained on other data" in r.stderr and "--data-changed-ok" in r.stderr, r.stderr
    losses, _ = train(tmp_path, "b", *other[len(RUN):], "--data-changed-ok")
    assert len(losses) == 1


def test_a_blend_trains_and_its_validation_reads_both_corpora(data, tmp_path, capsys):
    losses, out = train(tmp_path, "blend", "--data", f"0.7:{data / 'a'},0.3:{data / 'b'}", "--pp", "2",
                        "--steps", "2", "--micro-batch", "2", "--microbatches", "2", "--eval-every", "2",
                        "--eval-batches", "1")
    assert len(losses) == 2 and all(np.isfinite(losses))
    write_docs(tmp_path / "c.jsonl", 20, 2)
    assert main(["data", "prepare", "--input", str(tmp_path / "c.jsonl"), "--output", str(tmp_path / "c"),
                 "--vocab-size", "250", "--workers", "1", "--no-progress"]) == 0
    capsys.readouterr()
    assert_one_line_exit_2(capsys, [*RUN, "--data", f"1:{data / 'a'},1:{tmp_path / 'c'}", "--pp", "1", "--steps", "1"],
                           mentions="prepared with different tokenizers")


def test_a_tokenizer_larger_than_the_embedding_is_refused_in_one_line(data, tmp_path, capsys):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(f"w{i}" for i in range(400))], trainers.WordLevelTrainer(
        vocab_size=400, special_tokens=["[UNK]"], show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() > 256
    assert_one_line_exit_2(capsys, [*RUN, "--data", str(data / "a.jsonl"), "--tokenizer", tmp_path / "tokenizer.json",
                                    "--pp", "1", "--steps", "1", "--cache-dir", tmp_path / "cache"],
                           mentions="model's vocab_size is 256")
    corpus = PreparedCorpus.open(data / "a")
    assert corpus.vocab_size == 256 and corpus.val  # the module's corpus fits gpt-tiny exactly


def test_a_megatron_prefix_trains_and_ids_past_the_vocabulary_are_one_line(data, tmp_path):
    """A bare PREFIX.bin/.idx (as Megatron's preprocess_data.py writes it, byte for byte: tests/test_indexed.py)
    trains unchanged; with no tokenizer to vouch for its ids, a read that finds one past the embedding stops
    the run with one line."""
    from mp_toolkit.data.indexed import IndexedDataset, IndexedWriter

    ours = PreparedCorpus.open(data / "a").train[0]
    with IndexedWriter(tmp_path / "corpus_text_document", np.uint16) as w:
        for d in range(ours.num_documents):
            w.add_document([ours[i] for i in ours.document(d)])
        w.finalize()
    losses, _ = train(tmp_path, "megatron", "--data", tmp_path / "corpus_text_document", "--pp", "2", "--steps", "2",
                      "--micro-batch", "2")
    assert len(losses) == 2 and np.isfinite(losses).all()
    assert IndexedDataset(tmp_path / "corpus_text_document").num_documents == ours.num_documents
    with IndexedWriter(tmp_path / "wide", np.uint16) as w:
        for _ in range(40):
            w.add_document([np.arange(300, 340)])  # ids past gpt-tiny's 256
        w.finalize()
    r = run_mpt([*RUN, "--data", tmp_path / "wide", "--pp", "1", "--steps", "1", "--micro-batch", "2"], timeout=300,
                env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode != 0 and len(lines) >= 1 and "is not below the model's vocab_size 256" in lines[0], r.stderr
