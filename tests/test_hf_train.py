"""`mpt train --hf DIR`: HuggingFace save_pretrained directories trained by the CLI.

Tiny random GPT-2, Llama and BERT models are saved into tmp_path with ``save_pretrained`` (no hub),
with or without a tokenizer.json built here with `tokenizers`; every run is a real `mpt train`
process (it starts its ranks itself over gloo) on a small local corpus, fp32.
"""

import json
import math
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from mp_toolkit.checkpoint import open_checkpoint
from tests.cli_helpers import assert_one_line_exit_2
from tests.mpt_command import run_mpt

VOCAB = 320
COMMON = ["train", "--steps", "3", "--microbatches", "2", "--micro-batch", "2", "--seq-len", "32", "--threads", "1",
          "--no-progress", "--timeout", "60", "--lr", "1e-2"]


def mpt(*args, timeout=240):
    return run_mpt(args, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """This interpreter's json package (~50 kB of Python in 5 files)."""
    out = tmp_path_factory.mktemp("corpus")
    for f in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py")):
        shutil.copy(f, out / f.name)
    return out


def texts(corpus):
    return [f.read_text(encoding="utf-8") for f in sorted(corpus.iterdir())]


_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
MODELS = {  # kind: (config class, model class, config kwargs); eos 0 is the BPE's <|endoftext|>
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                                   eos_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                      max_position_embeddings=64, bos_token_id=0, eos_token_id=0)),
    "BertForPreTraining": ("BertConfig", "BertForPreTraining", _BERT),
    "BertForMaskedLM": ("BertConfig", "BertForMaskedLM", _BERT),
}


def save_model(path, kind, tokenizer=None, **overrides):
    """A random tiny HF model of ``kind`` saved with save_pretrained (dropout off: runs are deterministic)."""
    import transformers as tf

    tf.utils.logging.disable_progress_bar()  # save_pretrained's bar would reach capsys's stderr
    torch.manual_seed(0)
    config_cls, model_cls, kwargs = MODELS[kind]
    getattr(tf, model_cls)(getattr(tf, config_cls)(**(kwargs | overrides))).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save(str(Path(path) / "tokenizer.json"))
    return Path(path)


def bpe_tokenizer(corpus, vocab_size=300):
    """A byte-level BPE (GPT-2 style) trained on the corpus; <|endoftext|> is id 0, the models' eos."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts(corpus), vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False)
    return tok


def losses_of(tmp_path, name, *args):
    """(per-step losses from the metrics file, stdout) of a run that must succeed."""
    metrics = tmp_path / f"{name}.jsonl"
    r = mpt(*COMMON, "--metrics", metrics, "--cache-dir", tmp_path / "cache", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [row["loss"] for row in rows]
    assert all(math.isfinite(x) for x in losses) and len(losses) == len({row["step"] for row in rows})
    return losses, r.stdout


EVAL = ["--eval-every", "2", "--eval-batches", "1"]


def validation_rows(tmp_path, name) -> list[dict]:
    """The metrics rows of run ``name`` (`losses_of`) that carry a validation."""
    rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    found = [row for row in rows if "val_loss" in row]
    assert found, rows
    return found


def test_gpt2_without_a_tokenizer_trains_one_and_pp2_equals_pp1(tmp_path, corpus):
    """No tokenizer.json: a byte-level BPE is trained on --data with the model's vocab_size (said once).
    GPT-2 ties wte / lm_head across the two stages, so pp=2 sums that gradient in another order:
    tests/test_cli.py's tied-head tolerance, 1e-6 relative (the first loss, before any step, is equal)."""
    d = save_model(tmp_path / "gpt2", "gpt2")
    one, out = losses_of(tmp_path, "pp1", "--hf", d, "--data", corpus, "--pp", "1")
    two, out2 = losses_of(tmp_path, "pp2", "--hf", d, "--data", corpus, "--pp", "2")
    assert "(hf GPT2LMHeadModel)" in out
    assert out2.count(f"has no tokenizer.json, training a byte-level BPE on --data {corpus} with the model's "
                      f"vocab_size {VOCAB}") == 1  # rank 0 only
    assert one[0] == two[0] and two == pytest.approx(one, rel=1e-6)
    assert two[-1] < two[0] - 0.05, two  # lr 1e-2 from ln(320) = 5.77


def test_llama_with_its_tokenizer_json_pp2_equals_pp1_bitwise(tmp_path, corpus):
    """DIR/tokenizer.json encodes the corpus (prepared once under --cache-dir). Llama's embedding and head
    are untied, so the pipeline run is bitwise the single-process one (DESIGN.md invariant 1)."""
    d = save_model(tmp_path / "llama", "llama", bpe_tokenizer(corpus))
    one, out = losses_of(tmp_path, "pp1", "--hf", d, "--data", corpus, "--pp", "1")
    # 2 ranks x 2 model chunks: 4 stages, 3 boundaries crossed by the mask and the position ids
    two, out2 = losses_of(tmp_path, "int", "--hf", d, "--data", corpus, "--pp", "2", "--schedule", "interleaved")
    assert f"tokenizer: {d / 'tokenizer.json'}" in out and "(hf LlamaForCausalLM)" in out
    assert len(list((tmp_path / "cache").glob("prepared/*/manifest.json"))) == 1  # prepared once, read again
    assert out.count("data: preparing") == 1 and "data: preparing" not in out2
    assert two == one
    assert one[-1] < one[0] - 0.05, one


def test_resume_on_another_layout_and_export_the_checkpoint(tmp_path, corpus):
    """Save at step 2 on pp=2, resume to step 4 on pp=1 x tp=2 (vocab-parallel loss): the losses of
    steps 3-4 match an uninterrupted pp=2 run to 1e-5 relative (tests/test_cli.py's tp tolerance).
    The manifest holds the HF config, so export_checkpoint needs no config and from_pretrained loads
    the checkpoint's tensors bit for bit."""
    from transformers import AutoModelForCausalLM

    from mp_toolkit.export.checkpoint import export_checkpoint
    from mp_toolkit.hf.adapters import hf_name_map

    d = save_model(tmp_path / "llama", "llama", bpe_tokenizer(corpus))
    run = ["--hf", d, "--data", corpus, "--steps", "4"]
    full, _ = losses_of(tmp_path, "full", *run, "--pp", "2")
    losses_of(tmp_path, "a", *run, "--steps", "2", "--pp", "2", "--save-dir", tmp_path / "ck")
    resumed, out = losses_of(tmp_path, "b", *run, "--pp", "1", "--tp", "2", "--save-dir", tmp_path / "ck",
                             "--resume", "latest")
    assert "resumed from" in out and "at step 2" in out
    assert resumed == pytest.approx(full[2:], rel=1e-5)
    ck = open_checkpoint(tmp_path / "ck")
    assert ck.step == 4 and ck.manifest["model"]["family"] == "hf"
    assert ck.manifest["hf_config"]["architectures"] == ["LlamaForCausalLM"]
    assert sorted(ck.layer_names) == ["embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "lm_head", "norm"]
    loaded = AutoModelForCausalLM.from_pretrained(export_checkpoint(tmp_path / "ck", tmp_path / "out"))
    state = {k: v for layer in ck.layer_names for k, v in ck.read_layer(layer).items()}
    want = loaded.state_dict()
    assert all(torch.equal(state[ours], want[theirs[0]]) for ours, theirs in hf_name_map(loaded).items())
    assert loaded.config.vocab_size == VOCAB and loaded.config.num_key_value_heads == 2


def test_bert_with_a_wordpiece_tokenizer_uses_its_special_ids(tmp_path, corpus):
    """An HF BERT tokenizer's [PAD] [CLS] [SEP] [MASK] build the MLM + NSP pairs; its [PAD] (id 4
    here, not BERT's default 0) becomes the model's pad_token_id, stored in the manifest. At init
    the model guesses uniformly: MLM ln(320) + NSP ln(2) = 6.46."""
    from tokenizers.implementations import BertWordPieceTokenizer

    tok = BertWordPieceTokenizer()
    specials = ["[UNK]", "[CLS]", "[SEP]", "[MASK]", "[PAD]"]
    tok.train_from_iterator(texts(corpus), vocab_size=300, special_tokens=specials, show_progress=False)
    d = save_model(tmp_path / "bert", "BertForPreTraining", tok)
    losses, out = losses_of(tmp_path, "bert", "--hf", d, "--data", corpus, "--pp", "2", "--seq-len", "64",
                            "--save-dir", tmp_path / "ck", *EVAL)
    assert "(hf BertForPreTraining)" in out and f"tokenizer: {d / 'tokenizer.json'}" in out
    assert losses[0] == pytest.approx(math.log(VOCAB) + math.log(2), abs=0.05)
    assert open_checkpoint(tmp_path / "ck").manifest["hf_config"]["pad_token_id"] == tok.token_to_id("[PAD]") == 4
    for row in validation_rows(tmp_path, "bert"):  # MLM + NSP = the loss; perplexity of the MLM part
        assert row["val_loss"] == pytest.approx(row["val_mlm_loss"] + row["val_nsp_loss"], rel=1e-6)
        assert row["val_ppl"] == pytest.approx(math.exp(row["val_mlm_loss"])) and 0 <= row["val_mlm_accuracy"] <= 1
    assert "MLM loss" in out and "NSP loss" in out and "MLM accuracy" in out


def test_bert_mlm_without_a_tokenizer(tmp_path, corpus):
    """BertForMaskedLM with our corpus tokenizer (BPE + the 4 specials, within vocab_size), its tied
    decoder on the last stage, on 2 stages x 2 data-parallel replicas: the loss is the MLM part of
    the MLM + NSP batches only, ln(320) = 5.77 at init."""
    d = save_model(tmp_path / "mlm", "BertForMaskedLM")
    losses, out = losses_of(tmp_path, "mlm", "--hf", d, "--data", corpus, "--seq-len", "64", "--pp", "2", "--dp", "2",
                            *EVAL)
    assert "has no tokenizer.json" in out
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.05)
    for row in validation_rows(tmp_path, "mlm"):  # no NSP head: the loss is the MLM loss
        assert "val_nsp_loss" not in row and row["val_loss"] == pytest.approx(row["val_mlm_loss"], rel=1e-6)
        assert 0 <= row["val_mlm_accuracy"] <= 1


def test_bert_tp2_equals_tp1(tmp_path, corpus):
    """--hf BERT under --tp 2 (its plan: heads, feed-forward, and the word embedding with the tied
    MLM decoder over the vocabulary, 320 padded to 512): the MLM + NSP losses of a single rank to
    1e-5 relative (tests/test_cli.py's tp tolerance: fp32 reduction order)."""
    d = save_model(tmp_path / "bert", "BertForPreTraining")
    run = ["--hf", d, "--data", corpus, "--pp", "1", "--seq-len", "64", *EVAL]
    one, _ = losses_of(tmp_path, "tp1", *run)
    two, out = losses_of(tmp_path, "tp2", *run, "--tp", "2")
    assert f"tp 2 (vocab {VOCAB} padded to 512)" in out, out
    assert two == pytest.approx(one, rel=1e-5) and one[0] != one[-1]
    # the validation figures from the vocabulary shards (padded rows never the largest logit)
    for a, b in zip(validation_rows(tmp_path, "tp1"), validation_rows(tmp_path, "tp2"), strict=True):
        assert [b[k] for k in ("val_loss", "val_mlm_loss", "val_nsp_loss")] == pytest.approx(
            [a[k] for k in ("val_loss", "val_mlm_loss", "val_nsp_loss")], rel=1e-5)
        assert b["val_mlm_accuracy"] == a["val_mlm_accuracy"]


def test_mpt_plan_takes_the_directory(tmp_path):
    """`mpt plan --model DIR` reads DIR/config.json: by parameters the untied embedding and head
    (10k each) balance two blocks (9k each) on either side of the cut."""
    d = save_model(tmp_path / "llama", "llama")
    r = mpt("plan", "--model", d, "--pp", "2", "--seq-len", "32", "--method", "parameters", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "embed_tokens..layers.1" in r.stdout and "layers.2..lm_head" in r.stdout, r.stdout


def test_bad_hf_directories_are_one_line_exit_2(capsys, tmp_path, corpus):
    import transformers as tf

    tf.utils.logging.disable_progress_bar()
    args = [*COMMON, "--data", corpus, "--cache-dir", tmp_path / "cache"]
    assert_one_line_exit_2(capsys, [*args, "--hf", tmp_path / "nowhere"], mentions="no such directory")
    (tmp_path / "empty").mkdir()
    assert_one_line_exit_2(capsys, [*args, "--hf", tmp_path / "empty"], mentions="has no config.json")
    opt = tmp_path / "opt"
    tf.OPTForCausalLM(tf.OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                   num_attention_heads=2, max_position_embeddings=64,
                                   word_embed_proj_dim=16)).save_pretrained(opt)
    line = assert_one_line_exit_2(capsys, [*args, "--hf", opt], mentions="OPTForCausalLM is not supported by from_hf")
    assert "LlamaForCausalLM" in line
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(opt / "config.json", no_weights / "config.json")
    assert_one_line_exit_2(capsys, [*args, "--hf", no_weights], mentions="has no model.safetensors")

    llama = save_model(tmp_path / "llama", "llama")
    assert_one_line_exit_2(capsys, [*args, "--hf", llama, "--model", "gpt-tiny"],
                           mentions="--model gpt-tiny and --hf")
    assert_one_line_exit_2(capsys, [*args, "--hf", llama, "--seq-len", "65"],
                           mentions="--seq-len 65 exceeds")
    assert_one_line_exit_2(capsys, [*args, "--hf", llama, "--tp", "4"],
                           mentions="--tp 4 does not divide num_key_value_heads=2")
    bert = save_model(tmp_path / "bert", "BertForPreTraining")
    assert_one_line_exit_2(capsys, [*args, "--hf", bert, "--tp", "3"], mentions="--tp 3 does not divide n_head=4")
    big = save_model(tmp_path / "big_tok", "llama", bpe_tokenizer(corpus, vocab_size=400))
    assert_one_line_exit_2(capsys, [*args, "--hf", big],
                           mentions=f"tokenizer.json has 400 tokens but the model's vocab_size is {VOCAB}")
    small = save_model(tmp_path / "small", "llama", vocab_size=128)
    assert_one_line_exit_2(capsys, [*args, "--hf", small], mentions="has no tokenizer.json and its vocab_size 128")


def test_llama_sequence_parallel_saves_a_checkpoint_that_resumes_without_it(tmp_path, corpus):
    """--tp 2 --sequence-parallel on HF Llama (its plan: attention and MLP gather the sequence), saved
    at step 2 and resumed on pp 2 without tp: the checkpoint holds full tensors whatever the layout,
    so steps 3-4 match the uninterrupted sequence-parallel run to 1e-5 relative (tp's tolerance)."""
    d = save_model(tmp_path / "llama", "llama", bpe_tokenizer(corpus))
    run = ["--hf", d, "--data", corpus, "--steps", "4"]
    sp = ["--pp", "1", "--tp", "2", "--sequence-parallel"]
    full, _ = losses_of(tmp_path, "full", *run, *sp)
    plain, _ = losses_of(tmp_path, "plain", *run, "--pp", "1", "--tp", "2")
    assert full[0] == plain[0] and full == pytest.approx(plain, rel=1e-5)
    losses_of(tmp_path, "a", *run, *sp, "--steps", "2", "--save-dir", tmp_path / "ck")
    resumed, out = losses_of(tmp_path, "b", *run, "--pp", "2", "--save-dir", tmp_path / "ck", "--resume", "latest")
    assert "resumed from" in out and "sequence_parallel True -> False" not in out  # a layout choice, not a setting
    assert resumed == pytest.approx(full[2:], rel=1e-5)


def test_llama_context_parallel_trains_the_single_process_model(tmp_path, corpus, capsys):
    """--cp 2 on HF Llama (the ring in HF's own decoder layers, rotary positions from the zig-zag
    position ids): the losses of one process within tp's 1e-5. A Mistral sliding window narrower than
    the sequence is refused in one line; one as wide trains (its mask is the causal one)."""
    d = save_model(tmp_path / "llama", "llama", bpe_tokenizer(corpus))
    one, _ = losses_of(tmp_path, "one", "--hf", d, "--data", corpus, "--pp", "1")
    cp, out = losses_of(tmp_path, "cp", "--hf", d, "--data", corpus, "--pp", "1", "--cp", "2")
    assert cp == pytest.approx(one, rel=1e-5)
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    config = json.loads((d / "config.json").read_text()) | {"model_type": "mistral", "sliding_window": 8,
                                                             "architectures": ["MistralForCausalLM"]}
    (mistral / "config.json").write_text(json.dumps(config))
    shutil.copy(d / "model.safetensors", mistral / "model.safetensors")
    assert_one_line_exit_2(capsys, [*COMMON, "--hf", mistral, "--data", corpus, "--pp", "1", "--cp", "2"],
                           mentions="a sliding window of 8 tokens, narrower than --seq-len 32")
    (mistral / "config.json").write_text(json.dumps(config | {"sliding_window": 32}))
    whole, _ = losses_of(tmp_path, "whole", "--hf", mistral, "--data", corpus, "--pp", "1")
    wide, _ = losses_of(tmp_path, "wide", "--hf", mistral, "--data", corpus, "--pp", "1", "--cp", "2")
    assert wide == pytest.approx(whole, rel=1e-5)  # a window as wide as the sequence: the causal mask
