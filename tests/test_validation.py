"""`mpt train --eval-every N --eval-batches K` (a held-out split), and the scalar loggers
(`--tensorboard`, `--csv`, a DeepSpeed config's ``tensorboard`` / ``csv_monitor`` / ``wandb``).

The split: disjoint from training, the same sequences on every layout and on resume. The
validation loss: bitwise equal between pp=1 and pp=2 (untied model), within the measured floor
(tests/floor.py) at tp=2 x dp=2, bitwise equal after a resume. TensorBoard event files are read
back with tensorboard's own EventAccumulator and hold the metrics rows' values.
"""

import csv
import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mp_toolkit.data.feed import Wanted, feed
from mp_toolkit.data.lm import MicroBatches, SyntheticSamples, rank0_first
from mp_toolkit.errors import DataError
from tests.cli_helpers import assert_one_line_exit_2
from tests.floor import assert_within, rel_err
from tests.mpt_command import run_mpt

# the module's fixture runs five `mpt train` processes (about 100 s on an idle 2-core machine): the
# suite's 300 s per test would count them all against the first test that uses it
pytestmark = pytest.mark.timeout(1200)

# --- the split (no processes) -------------------------------------------------------------------


def rows_of(batches) -> list[tuple]:
    return [tuple(seq.tolist()) for x, _ in batches for seq in x]


def test_held_out_rows_are_disjoint_from_training_and_the_same_on_every_dp_layout():
    train, val = SyntheticSamples.split(1000, 5, seed=0, tokens=40 * 6, holdout=8)
    one = MicroBatches(train, 2, holdout=8, validation=val)
    trained = rows_of(next(one) for _ in range(3 * one.batches_per_epoch))  # three epochs: every order
    held = rows_of(one.held_out())
    assert len(held) == 8 and not set(held) & set(trained)
    assert len(set(trained)) == 32  # and every other row trains
    # dp = 2 with half the micro-batch: the two replicas together hold out the same sequences
    halves = [rows_of(MicroBatches(train, 1, dp_rank=r, dp_size=2, holdout=8, validation=val).held_out())
              for r in (0, 1)]
    assert sorted(halves[0] + halves[1]) == sorted(held)
    assert rows_of(one.held_out()) == held  # every evaluation reads it again from its first sequence
    with pytest.raises(DataError, match=r"fewer than the 9 held-out sequences"):
        MicroBatches(train, 2, holdout=9, validation=val)
    with pytest.raises(DataError, match=r"synthetic data of 40 sequences cannot hold out 40 for validation"):
        SyntheticSamples.split(1000, 5, seed=0, tokens=40 * 6, holdout=40)


def test_bert_held_out_batches_are_masked_the_same_way_every_time(tmp_path):
    fed = feed("synthetic", Wanted(300, 32, 0, pairs=True), tmp_path, total=64)
    a = MicroBatches(fed.train, 4, seed=0, holdout=8, validation=fed.validation)
    first = list(a.held_out())
    again = list(MicroBatches(fed.train, 4, seed=0, holdout=8, validation=fed.validation).held_out())
    assert len(first) == 2
    for (x, y), (x2, y2) in zip(first, again):
        assert all(torch.equal(p, q) for p, q in zip(x + y, x2 + y2))
    train_docs = set(fed.corpora[0].manifest["totals"]["train"].items())
    assert fed.corpora[0].val and train_docs  # validation documents are prepared apart from training's


# --- mpt train: layouts, resume, loggers ----------------------------------------------------------

RUN = ["train", "--data", "synthetic", "--steps", "4", "--seq-len", "16", "--threads", "1", "--no-progress",
       "--lr", "1e-2", "--optimizer", "lamb", "--eval-every", "2", "--eval-batches", "2", "--timeout", "60"]


def mpt(*args, timeout=300):
    return run_mpt(args, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def train(tmp, name, *args):
    metrics = tmp / f"{name}.jsonl"
    r = mpt(*RUN, "--metrics", metrics, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line) for line in metrics.read_text().splitlines()], r.stdout


def val_losses(rows) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same global batch of 8 sequences per step on five layouts (an untied GPT, so pp = 2 is
    bitwise); pp = 2 through a DeepSpeed config that enables its tensorboard and csv_monitor."""
    tmp = tmp_path_factory.mktemp("validation")
    model = tmp / "config.json"
    model.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 128, "n_positions": 32, "n_embd": 32,
                                 "n_layer": 2, "n_head": 4, "tie_word_embeddings": False}))
    ds = tmp / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                              "tensorboard": {"enabled": True, "output_path": str(tmp / "tb"), "job_name": "pp2"},
                              "csv_monitor": {"enabled": True, "output_path": str(tmp / "csv"), "job_name": "pp2"}}))
    m = ["--model", model]
    out = {"tmp": tmp, "model": model}
    out["one"] = train(tmp, "one", *m, "--pp", "1", "--microbatches", "4", "--micro-batch", "2",
                       "--tensorboard", tmp / "tb_one", "--csv", tmp / "one.csv")
    out["floor"] = train(tmp, "floor", *m, "--pp", "1", "--microbatches", "8", "--micro-batch", "1")
    out["pp2"] = train(tmp, "pp2", *m, "--config", ds, "--pp", "2", "--schedule", "zbh1",
                       "--save-dir", tmp / "ck", "--save-every", "2")
    out["tp2dp2"] = train(tmp, "tp2dp2", *m, "--pp", "1", "--tp", "2", "--dp", "2", "--microbatches", "2",
                          "--micro-batch", "2")
    # pp = 2 again from its step-2 checkpoint: its TensorBoard / CSV steps 3, 4 replace the first run's; under
    # ZB-V (issue 38), whose last stage, the loss and validation, are on rank 0: the same numbers, bitwise
    out["resumed"] = train(tmp, "resumed", *m, "--config", ds, "--pp", "2", "--schedule", "zbv",
                           "--save-dir", tmp / "ck2", "--resume", tmp / "ck" / "step-00000002")
    return out


def logged_rows(runs, run):
    """The rows a run's loggers hold last: pp2's steps 1-2 and the resumed run's 3-4."""
    return runs[run][0] if run != "pp2" else runs["pp2"][0][:2] + runs["resumed"][0]


def test_validation_rows_progress_line_and_summary(runs):
    rows, stdout = runs["one"]
    assert sorted(val_losses(rows)) == [2, 4]  # every 2 steps and after the last
    for r in rows:
        if "val_loss" in r:
            assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) and 0 < r["val_loss"] < 10
            assert f"step {r['step']}: loss {r['loss']:.4f}, validation loss {r['val_loss']:.4f}" in stdout
    assert f"validation loss {rows[-1]['val_loss']:.4f} (perplexity {rows[-1]['val_ppl']:.2f}) after step 4" in stdout


def test_validation_loss_is_the_same_on_every_layout(runs):
    one, floor = val_losses(runs["one"][0]), val_losses(runs["floor"][0])
    assert val_losses(runs["pp2"][0]) == one  # pipeline only: bitwise (ZB-H1's forward-only actions)
    ratios = []
    for step in one:  # micro-batches of 1 instead of 2: the same sequences, another reduction order
        err_floor = rel_err(floor[step], one[step])
        ratios.append(assert_within(rel_err(val_losses(runs["tp2dp2"][0])[step], one[step]), err_floor,
                                    f"tp=2 x dp=2 validation loss at step {step}"))
    print(f"\nworst err / floor: {max(ratios):.2f}")


def test_resume_reports_the_uninterrupted_validation_loss(runs):
    rows, stdout = runs["resumed"]
    assert "at step 2" in stdout and [r["step"] for r in rows] == [3, 4]
    assert val_losses(rows) == {4: val_losses(runs["pp2"][0])[4]}


def scalars(directory) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in the TensorBoard event files under ``directory``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("run,where", [("one", "tb_one"), ("pp2", "tb/pp2")])
def test_tensorboard_event_files_hold_the_metrics(runs, run, where):
    rows = logged_rows(runs, run)
    got = scalars(runs["tmp"] / where)
    f32 = lambda v: float(np.float32(v))  # event files store float32
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("tokens_per_s", "train/tokens_per_s"), ("loss_scale", "train/loss_scale")):
        assert got[tag] == {r["step"]: f32(r[key]) for r in rows}, tag
    assert got["val/loss"] == {s: f32(v) for s, v in val_losses(rows).items()}
    assert sorted(got["val/ppl"]) == [2, 4]
    stages = {t["stage"] for t in rows[-1]["trust_ratio"]}
    for s in stages:  # LAMB: per stage min / median / max
        assert got[f"trust_ratio/stage{s}/median"] == {r["step"]: f32(r["trust_ratio"][s]["median"]) for r in rows}
    ranks = len(rows[-1]["peak_memory_bytes"])
    assert got[f"memory/peak_rank{ranks - 1}_mib"] == {4: f32(rows[-1]["peak_memory_bytes"][-1] / 2**20)}


def test_csv_holds_every_scalar(runs):
    for run, path in (("one", runs["tmp"] / "one.csv"), ("pp2", runs["tmp"] / "csv" / "pp2" / "metrics.csv")):
        rows = logged_rows(runs, run)
        with open(path, newline="") as f:
            lines = list(csv.reader(f))
        assert lines[0] == ["step", "tag", "value"]
        table = {(int(s), tag): float(v) for s, tag, v in lines[1:]}
        assert {s: table[(s, "train/loss")] for s in range(1, 5)} == {r["step"]: r["loss"] for r in rows}
        assert {s: v for (s, tag), v in table.items() if tag == "val/loss"} == val_losses(rows)


def test_bad_validation_and_logger_settings_are_one_line(capsys, tmp_path):
    base = ["train", "--model", "gpt-tiny", "--seq-len", "16", "--data", "synthetic", "--pp", "1", "--threads", "1"]
    assert_one_line_exit_2(capsys, [*base, "--eval-every", "-1"], mentions="--eval-every -1")
    assert_one_line_exit_2(capsys, [*base, "--eval-every", "1", "--eval-batches", "0"], mentions="--eval-batches 0")
    assert_one_line_exit_2(capsys, [*base, "--no-progress", "--steps", "1", "--eval-every", "1",
                                    "--eval-batches", "200"], mentions="cannot hold out 6400 for validation")
    if importlib.util.find_spec("wandb") is None:
        ds = tmp_path / "ds.json"
        ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                  "wandb": {"enabled": True, "project": "p"}}))
        assert_one_line_exit_2(capsys, [*base, "--config", ds], mentions="wandb.enabled")


# --- BERT: MLM / NSP losses and MLM accuracy through the engine ---------------------------------------

def bert_eval_rank(rank, world, pp, tp, cache):
    """[loss, MLM loss, NSP loss, MLM accuracy] of two held-out global batches through `eval_metrics` on a
    (pp, tp) grid, `eval_batch` of the same batches, and the unsplit model's values in fp32 and fp64."""
    import dataclasses

    from model_zoo import bert
    from mp_toolkit.parallel.context import build_context
    from mp_toolkit.run.compose import build_engine
    from mp_toolkit.run.config import TrainConfig
    from mp_toolkit.run.plan import resolve_run
    from mp_toolkit.run.validation import MLM_METRICS, mlm_metrics

    torch.set_num_threads(1)
    wanted = Wanted(bert.PRESETS["bert-tiny"].vocab_size, 32, 0, pairs=True)
    fed = rank0_first(lambda: feed("synthetic", wanted, Path(cache), total=64), rank)  # rank 0 prepares first
    config = dataclasses.replace(bert.PRESETS["bert-tiny"], pad_token_id=fed.special.pad)
    m, mbs = 2, 4
    data = MicroBatches(fed.train, mbs, seed=0, holdout=2 * m * mbs, validation=fed.validation)
    cfg = TrainConfig.of(model="bert-tiny", pp=pp, tp=tp, microbatches=m, micro_batch=mbs, seq_len=32,
                         partition="uniform", precision="fp32")
    ctx = build_context(pp, tp, 1)
    torch.manual_seed(0)
    with torch.device("meta"):  # as mpt train builds it: each rank draws only its own layers
        model = bert.BertForPreTraining(config)
    engine = build_engine(resolve_run(cfg), ctx, model)
    metrics = mlm_metrics(engine.loss_fn, ctx.tp_group)
    held = data.held_out()
    got = [engine.eval_metrics(held, metrics, len(MLM_METRICS)) for _ in range(2)]
    held = data.held_out()
    losses = [engine.eval_batch(held) for _ in range(2)]
    refs = {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        model = bert.BertForPreTraining(config).to(dtype).eval()
        reference = mlm_metrics(bert.pretraining_loss)
        rows = []
        with torch.no_grad():
            batches = list(data.held_out())
            for k in range(2):
                total = torch.zeros(4, dtype=torch.float32)
                for x, y in batches[k * m:(k + 1) * m]:
                    total += reference(model(*x), y) / m
                rows.append(total.tolist())
        refs[dtype] = rows
    return got, losses, refs[torch.float32], refs[torch.float64]


@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2)])
def test_bert_mlm_nsp_losses_and_accuracy_equal_the_unsplit_model(pp, tp, tmp_path):
    """pp = 2: bitwise the unsplit model's values; tp = 2 (vocabulary-sharded MLM logits, accuracy from
    the shards): within the measured floor, the accuracy exactly. The loss column is `eval_batch`'s."""
    from tests.dist_harness import run_world

    got, losses, ref32, ref64 = run_world(bert_eval_rank, pp * tp, pp, tp, str(tmp_path), timeout_s=240)[-1]
    assert [row[0] for row in got] == losses  # one pass gives the loss eval_batch gives, bitwise
    for row in got + ref32:
        assert row[0] == pytest.approx(row[1] + row[2], rel=1e-6) and 0 <= row[3] <= 1  # untrained: ~0
    if tp == 1:
        assert got == ref32
        return
    for k in range(2):
        assert got[k][3] == ref32[k][3]
        for i, name in enumerate(("loss", "MLM loss", "NSP loss")):
            assert_within(rel_err(got[k][i], ref64[k][i]), rel_err(ref32[k][i], ref64[k][i]), f"tp=2 {name} {k}")


def accuracy_rank(rank, world):
    """`mlm_accuracy` of this rank's vocabulary shard of fixed logits, and of the whole on one device."""
    from mp_toolkit.parallel.context import build_context
    from mp_toolkit.run.validation import mlm_accuracy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, 16, generator=g)
    logits[..., 14:] = -float("inf")  # padded vocabulary rows (rank 1's last two)
    labels = torch.randint(0, 14, (3, 10), generator=g)
    labels[0] = logits[0].argmax(-1)  # row 0 right (ids on both shards), a third of row 1 ignored
    labels[1, :3] = -100
    ctx = build_context(pp=1, tp=world, dp=1)
    shard = logits[..., rank * 8:(rank + 1) * 8]
    want = ((logits.argmax(-1) == labels) & (labels != -100)).sum() / (labels != -100).sum()
    return mlm_accuracy(shard, labels, ctx.tp_group).item(), mlm_accuracy(logits, labels).item(), want.item()


def test_mlm_accuracy_from_vocabulary_shards_is_the_argmax_accuracy():
    from tests.dist_harness import run_world

    for sharded, whole, want in run_world(accuracy_rank, 2, timeout_s=120):
        assert sharded == whole == want and 0.37 < want < 1  # row 0: 10 of the 27 labelled positions


def test_deepspeed_engine_reports_the_same_validation_loss(runs, tmp_path):
    """`--engine deepspeed` evaluates through DeepSpeed's own eval_batch on the same held-out split:
    its validation losses are ours (fp32; the losses agree as in tests/test_ds_engine.py)."""
    pytest.importorskip("deepspeed")
    metrics = tmp_path / "ds.jsonl"
    r = run_mpt([*RUN, "--metrics", metrics, "--model", runs["model"], "--pp", "2", "--microbatches", "4",
                 "--micro-batch", "2", "--engine", "deepspeed"], timeout=600,
                env=dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    ours = val_losses(runs["one"][0])
    assert val_losses(rows).keys() == ours.keys()
    assert list(val_losses(rows).values()) == pytest.approx(list(ours.values()), rel=1e-6)
