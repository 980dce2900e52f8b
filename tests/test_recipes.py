"""recipes/: the DeepSpeed configs parse; `make_tokenizer.py` builds GPT-2- and BERT-style tokenizers locally;
each `run.sh` prepares its corpus, then trains on it (the smoke runs under the deepspeed launcher, CPU, gloo,
2 processes; the production path prepares once and hands the launcher the prepared directory); the entry also
runs under torchrun and `mpt train --config`."""

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from mp_toolkit.cli import main
from mp_toolkit.data.feed import special_ids
from mp_toolkit.data.prepared import PreparedCorpus
from mp_toolkit.ds.config import read_ds_config
from mp_toolkit.optim.lr import WarmupDecayLR, WarmupLR
from mp_toolkit.run.launch import free_port

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
BIN = Path(sys.executable).parent
_spec = importlib.util.spec_from_file_location("make_tokenizer", RECIPES / "make_tokenizer.py")
make_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tokenizer)


def run_group(cmd, timeout, cwd=None, env=None):
    """Run ``cmd`` in its own process group; on timeout kill the whole group (launcher and ranks)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[0]} ran past {timeout}s:\n{out[-3000:]}")
    return proc.returncode, out


def env(**extra):
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1", **extra)


@pytest.mark.parametrize("dp,gas", [(1, 8), (8, 8)])
def test_gpt_recipe_config_parses(dp, gas):
    s = read_ds_config(RECIPES / "gpt_pretrain" / "ds_config.json", dp=dp)
    assert (s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps, s.train_batch_size) == (8, gas, 64 * dp)
    assert (s.precision, s.gradient_clipping, s.pp, s.partition) == ("bf16", 1.0, 2, "parameters")
    assert (s.optimizer.name, s.optimizer.lr, s.optimizer.min_trust, s.optimizer.max_trust) == (
        "lamb", 2e-3, 0.01, 10.0)
    assert s.scheduler == WarmupDecayLR(warmup_min_lr=0.0, warmup_max_lr=2e-3, warmup_num_steps=200,
                                        total_num_steps=5000, warmup_type="linear")
    assert s.ignored == ("steps_per_print", "wall_clock_breakdown")


@pytest.mark.parametrize("dp,gas", [(1, 32), (4, 8), (8, 4)])
def test_bert_recipe_config_parses(dp, gas):
    """train_batch_size 1024 with 32 per GPU: DeepSpeed derives the accumulation steps from dp."""
    s = read_ds_config(RECIPES / "bert_pretrain" / "ds_config.json", dp=dp)
    assert (s.train_batch_size, s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps) == (1024, 32, gas)
    assert (s.precision, s.fp16.loss_scale, s.fp16.hysteresis, s.pp, s.partition) == ("fp16", 0.0, 2, 2, "uniform")
    assert (s.optimizer.name, s.optimizer.lr, s.optimizer.eps, s.optimizer.bias_correction) == (
        "lamb", 6e-3, 1e-6, True)
    assert s.scheduler == WarmupLR(warmup_min_lr=0.0, warmup_max_lr=6e-3, warmup_num_steps=2000, warmup_type="linear")
    assert s.recompute is None and "pipeline.activation_checkpoint_interval" not in s.ignored  # 0: read, off


def losses(path):
    return [json.loads(line)["loss"] for line in Path(path).read_text().splitlines()]


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def assert_trained_on_what_it_prepared(out, work: Path, name: str, kind: str):
    """The smoke run built its tokenizer and prepared the corpus with it under WORK, and the ranks read that
    directory as it is (`mpt train` prepared nothing itself)."""
    prepared = work / name / "prepared"
    assert f"wrote {work / name / 'tokenizer' / 'tokenizer.json'}: {kind}, 512 tokens" in out, out[-3000:]
    assert f"prepared {prepared}: train " in out and "data: preparing" not in out, out[-3000:]
    assert f"'--data', '{prepared}'" in out  # the launcher's command line for each rank
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["tokenizer"]["sha256"] == sha256(work / name / "tokenizer" / "tokenizer.json")
    return manifest


def test_gpt_recipe_smoke_under_the_deepspeed_launcher(tmp_path):
    """`run.sh --smoke`: a 512-token byte-level BPE built from this repository's sources, the sources prepared
    with it, then the real deepspeed launcher starts 2 CPU processes (pipeline.stages 2) that train a 4-layer
    GPT for 30 steps on the prepared directory; the loss falls (measured 6.26 -> 5.92 with the config's "Lamb"
    as DeepSpeed's FusedLamb, whose clamped trust ratios on every tensor take smaller early steps than our
    rule: the smoke run's lr is 3e-2)."""
    metrics = tmp_path / "smoke.jsonl"
    code, out = run_group([str(RECIPES / "gpt_pretrain" / "run.sh"), "--smoke", "--metrics", str(metrics)],
                          timeout=150, env=env(DEEPSPEED=str(BIN / "deepspeed"), MASTER_PORT=str(free_port()),
                                               WORK=str(tmp_path)))
    assert code == 0, out[-3000:]
    assert "launch.py" in out and "--local_rank=1" in out  # deepspeed's launcher, which passes --local_rank
    assert "pp 2, tp 1, dp 1" in out and "optimizer lamb" in out
    assert out.count("keys not used by mp_toolkit: steps_per_print, wall_clock_breakdown") == 1  # rank 0, once
    manifest = assert_trained_on_what_it_prepared(out, tmp_path, "gpt_smoke", "byte-level BPE")
    assert not manifest["split_sentences"] and manifest["append_eod"]
    loss = losses(metrics)
    assert len(loss) == 30 and sum(loss[-5:]) / 5 < loss[0] - 0.25, loss


def test_bert_recipe_entry_under_torchrun(tmp_path):
    """The recipe's train.py needs no DeepSpeed: torchrun starts the same 2 ranks (LOCAL_WORLD_SIZE set)."""
    metrics = tmp_path / "m.jsonl"
    cmd = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "train.py", "--deepspeed_config", "ds_config.json",
           "--model", "bert-tiny", "--data", str(RECIPES.parent / "mp_toolkit"), "--seq-len", "64",
           "--micro-batch", "4", "--microbatches", "2", "--steps", "4", "--precision", "fp32", "--lr", "1e-2",
           "--threads", "1", "--no-progress", "--cache-dir", str(tmp_path / "cache"), "--metrics", str(metrics)]
    code, out = run_group(cmd, timeout=120, cwd=RECIPES / "bert_pretrain", env=env())
    assert code == 0, out[-3000:]
    assert "model bert-tiny (bert)" in out and "pp 2, tp 1, dp 1" in out and "optimizer lamb" in out
    assert len(losses(metrics)) == 4


def test_gpt_recipe_config_under_mpt_train(tmp_path, capsys):
    """`mpt train --config recipes/.../ds_config.json`, here on one process (--pp 1 overrides pipeline.stages)."""
    metrics = tmp_path / "m.jsonl"
    code = main(["train", "--config", str(RECIPES / "gpt_pretrain" / "ds_config.json"), "--pp", "1",
                 "--model", str(RECIPES / "gpt_pretrain" / "smoke_model.json"), "--data", "synthetic",
                 "--seq-len", "32", "--micro-batch", "2", "--microbatches", "2", "--steps", "3", "--precision", "fp32",
                 "--threads", "1", "--no-progress", "--metrics", str(metrics)])
    out = capsys.readouterr().out
    assert code == 0
    assert "overridden on the command line: --micro-batch, --microbatches, --pp, --precision" in out
    # WarmupDecayLR(linear, 200 warm-up iterations) from the file: DeepSpeed iterations -1, 0, 1
    assert [json.loads(line)["lr"] for line in metrics.read_text().splitlines()] == pytest.approx([0.0, 0.0, 1e-5])


def test_bert_recipe_smoke_under_the_deepspeed_launcher(tmp_path):
    """BERT's `run.sh --smoke` (issue 22): a 512-token WordPiece built from this repository's sources, the
    sources prepared with it into sentences, then the deepspeed launcher starts 2 CPU processes (pipeline.stages
    2; heartbeats on, as in every run) that pre-train bert-tiny (MLM + NSP) for 30 steps; the loss falls by
    more than its own step-to-step spread over the first five steps (measured 6.93 -> 6.77 on average)."""
    metrics = tmp_path / "smoke.jsonl"
    code, out = run_group([str(RECIPES / "bert_pretrain" / "run.sh"), "--smoke", "--metrics", str(metrics)],
                          timeout=240, env=env(DEEPSPEED=str(BIN / "deepspeed"), MASTER_PORT=str(free_port()),
                                               WORK=str(tmp_path)))
    assert code == 0, out[-3000:]
    assert "launch.py" in out and "pp 2, tp 1, dp 1" in out and " hung " not in out, out[-3000:]
    manifest = assert_trained_on_what_it_prepared(out, tmp_path, "bert_smoke", "WordPiece")
    assert manifest["split_sentences"] and manifest["totals"]["train"]["sequences"] > 10 * manifest["totals"][
        "train"]["documents"]  # sentences, not whole files
    loss = losses(metrics)
    noise = max(loss[:5]) - min(loss[:5])  # the floor: how much the loss moves between early steps
    assert len(loss) == 30 and sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - noise, loss


def corpus(tmp_path) -> Path:
    """A few small documents of several sentences each, as a folder of text files."""
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(6):
        (root / f"doc{i}.txt").write_text(
            f"The pipeline has {i + 2} stages. Each stage runs its layers! Does the loss fall? It does.\n"
            f"Micro-batches flow through stage {i}. Gradients accumulate over them.\n")
    return root


def test_make_tokenizer_bpe_is_byte_level_gpt2_style(tmp_path):
    """--kind bpe: every byte in the alphabet (any text round-trips, no unknown token), <|endoftext|> at id 0,
    at most --vocab-size tokens, GPT-2's split (a space starts the next word's token)."""
    line = make_tokenizer.make_tokenizer("bpe", 300, [str(corpus(tmp_path))], tmp_path / "tok")
    assert line.startswith(f"wrote {tmp_path / 'tok' / 'tokenizer.json'}: byte-level BPE, ") and "6 documents" in line
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 0 and 257 < tok.get_vocab_size() <= 300
    text = "Größe → 変換 and the stages\ttab"
    assert tok.decode(tok.encode(text).ids) == text
    words = tok.encode("the stages").tokens  # merges learnt from the corpus; GPT-2's space marker starts a word
    assert len(words) < len("the stages") and any(t.startswith("Ġst") for t in words), words


def test_make_tokenizer_wordpiece_is_bert_style(tmp_path):
    """--kind wordpiece: [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4, lowercased, ## continuations, BERT's pair
    template; and a corpus prepared with it (--split-sentences) gives BERT pairs their special ids."""
    make_tokenizer.make_tokenizer("wordpiece", 120, [str(corpus(tmp_path))], tmp_path / "tok")
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [0, 1, 2, 3, 4]
    assert tok.get_vocab_size() <= 120
    pair = tok.encode("The STAGES", "it does")
    assert pair.tokens[0] == "[CLS]" and pair.tokens[-1] == "[SEP]" and pair.tokens.count("[SEP]") == 2
    assert "stages" in pair.tokens and pair.type_ids[-1] == 1
    assert tok.decode(tok.encode("The loss falls").ids) == "the loss falls"
    assert main(["data", "prepare", "--input", str(tmp_path / "corpus"), "--output", str(tmp_path / "prep"),
                 "--tokenizer", str(tmp_path / "tok"), "--split-sentences", "--workers", "1", "--no-progress"]) == 0
    special, never = special_ids(PreparedCorpus.open(tmp_path / "prep"), "prep")
    assert (special.pad, special.cls, special.sep, special.mask) == (0, 2, 3, 4) and 1 in never  # [UNK] too


@pytest.mark.parametrize("kind,vocab,error", [
    ("bpe", 256, "--vocab-size 256 is too small for a byte-level BPE: use at least 257 (256 byte symbols + "
                 "<|endoftext|>)"),
    ("wordpiece", 8, "--vocab-size 8 is too small for a WordPiece vocabulary: use at least 24")])
def test_make_tokenizer_refuses_in_one_line(tmp_path, capsys, kind, vocab, error):
    argv = ["--kind", kind, "--vocab-size", str(vocab), "--input", str(corpus(tmp_path)), "--out", str(tmp_path)]
    assert make_tokenizer.main(argv) == 2
    assert capsys.readouterr().err == f"make_tokenizer.py: error: {error}\n"
    assert make_tokenizer.main(["--kind", kind, "--vocab-size", "500", "--input", str(tmp_path / "nope"),
                                "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"input {tmp_path / 'nope'} does not exist" in err
    assert not (tmp_path / "tokenizer.json").exists()


@pytest.mark.parametrize("recipe,kind,what", [("gpt_pretrain", "bpe", "byte-level BPE"),
                                              ("bert_pretrain", "wordpiece", "BERT WordPiece")])
def test_recipe_without_tokenizer_refuses_in_one_line(recipe, kind, what):
    """The production path needs TOKENIZER: one line says what to set, exit 2, nothing launched."""
    code, out = run_group([str(RECIPES / recipe / "run.sh")], timeout=30, env=env(DEEPSPEED="echo"))
    assert code == 2 and out.count("\n") == 1, out
    assert out.startswith(f"run.sh: set TOKENIZER to a local {what} tokenizer") and f"--kind {kind}" in out, out


@pytest.mark.parametrize("recipe,kind,model", [("gpt_pretrain", "bpe", "gpt2"),
                                               ("bert_pretrain", "wordpiece", "bert-large")])
def test_recipe_prepares_once_then_launches_on_the_prepared_directory(tmp_path, recipe, kind, model):
    """`TOKENIZER=... DATA=... ./run.sh` (the launcher echoed): DATA prepared into WORK with the tokenizer and the
    recipe's settings, the launcher given that directory; a second start finds it finished and encodes nothing."""
    make_tokenizer.make_tokenizer(kind, 300, [str(corpus(tmp_path))], tmp_path / "tok")
    run_env = env(DEEPSPEED="echo", MASTER_PORT="29500", TOKENIZER=str(tmp_path / "tok"),
                  DATA=str(tmp_path / "corpus"), WORK=str(tmp_path / "work"), WORKERS="1")
    prepared = tmp_path / "work" / f"{recipe.split('_')[0]}_prepared"
    outs = [run_group([str(RECIPES / recipe / "run.sh"), "--steps", "3"], timeout=60, env=run_env)
            for _ in range(2)]
    for i, (code, out) in enumerate(outs):
        assert code == 0, out
        summary, launch = out.strip().splitlines()
        assert summary.startswith(f"prepared {prepared}: train ")
        assert summary.endswith("1 workers; 6 chunks encoded, 0 done before" if i == 0 else
                                "0 chunks encoded, 0 done before"), summary
        assert launch.startswith("--num_gpus 8 --master_port 29500 train.py --deepspeed_config ds_config.json "
                                 f"--model {model} ")
        assert f" --data {prepared} " in launch and launch.endswith(" --steps 3")
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["tokenizer"]["sha256"] == sha256(tmp_path / "tok" / "tokenizer.json")
    assert manifest["val_fraction"] == 0.0005 and manifest["split_sentences"] == (kind == "wordpiece")
