"""Validation during `mpt train`: ``--eval-every N --eval-batches K``.

The held-out split is the last K x dp x microbatches x micro_batch sequences of the shuffled
dataset (`mp_toolkit.data.lm.MicroBatches`'s ``holdout``), which training never reads: the same
sequences on every (pp, tp, dp) layout and on resume. Every evaluation reads the whole split from
its first sequence, K global batches through the engine's `eval_batch` (forward only, the run's
own schedule and layout), so the values of successive evaluations are comparable and a run resumed
from a checkpoint reports what the uninterrupted run reports.

Rows get ``val_loss`` (the training loss function's value) and ``val_ppl``. BERT pre-training
(``--model bert-*``, or ``--hf`` with a BertForPreTraining directory; our engine) also gets
``val_mlm_loss``, ``val_nsp_loss`` and ``val_mlm_accuracy`` (the share of masked positions whose
largest logit is the original token; BertForMaskedLM, which has no NSP head, gets the two MLM figures),
computed on the last stage in one pass with the loss (`PipelineEngine.eval_metrics`; under
tensor parallelism from the vocabulary shards, never gathered), and its ``val_ppl`` is the
masked-LM perplexity, exp(val_mlm_loss). Each value is averaged like the loss: per micro-batch,
then over the global batch, then over the K batches.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_toolkit.engine.interface import TrainEngine
from mp_toolkit.parallel.tensor_parallel import vocab_parallel_cross_entropy
from mp_toolkit.parallel.tp_comms import group_rank
from mp_toolkit.run.config import TrainConfig

IGNORE_INDEX = -100
MLM_METRICS = ("val_loss", "val_mlm_loss", "val_nsp_loss", "val_mlm_accuracy")
MASKED_LM_METRICS = ("val_loss", "val_mlm_loss", "val_mlm_accuracy")


def evaluates_at(cfg: TrainConfig, step: int) -> bool:
    """Whether the run evaluates after ``step``: every ``eval_every`` steps and after the last."""
    return cfg.logging.eval_every > 0 and (step % cfg.logging.eval_every == 0 or step == cfg.steps)


def mlm_accuracy(logits: torch.Tensor, labels: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Share of positions with a label (not -100) whose largest logit is the label's (a tie counts).

    ``logits`` (B, T, V), or with ``tp_group`` this rank's vocabulary shard (B, T, Vp / tp) of
    `VocabParallelLMHead` (rank r holds ids [r Vp/tp, (r+1) Vp/tp), padded ids at -inf): the
    label's logit and the largest one are reduced over the group, two (B T,) vectors."""
    v = logits.shape[-1]
    flat, labels = logits.reshape(-1, v).float(), labels.reshape(-1)
    start = group_rank(tp_group) * v if tp_group is not None else 0
    local = labels - start
    mine = (local >= 0) & (local < v)
    at_label = torch.where(mine, flat.gather(1, local.clamp(0, v - 1)[:, None])[:, 0], torch.zeros_like(flat[:, 0]))
    best = flat.max(dim=-1).values
    if tp_group is not None:
        dist.all_reduce(at_label, op=dist.ReduceOp.SUM, group=tp_group)  # one rank holds each label
        dist.all_reduce(best, op=dist.ReduceOp.MAX, group=tp_group)
    valid = labels != IGNORE_INDEX
    return ((at_label >= best) & valid).sum().float() / valid.sum()


def mlm_metrics(loss_fn, tp_group=None):
    """(outputs, labels) -> [loss, MLM loss, NSP loss, MLM accuracy] of one BERT pre-training
    micro-batch: ``outputs`` (MLM logits, NSP logits (B, 2)), ``labels`` (MLM labels, NSP labels)."""

    def metrics(outputs, labels) -> torch.Tensor:
        (mlm_logits, nsp_logits), (mlm_labels, nsp_labels) = outputs, labels
        return torch.stack([loss_fn(outputs, labels).float(),
                            vocab_parallel_cross_entropy(mlm_logits, mlm_labels, tp_group),
                            F.cross_entropy(nsp_logits.float(), nsp_labels.reshape(-1)),
                            mlm_accuracy(mlm_logits, mlm_labels, tp_group)])

    return metrics


def masked_lm_metrics(loss_fn, tp_group=None):
    """(logits, labels) -> [loss, MLM loss, MLM accuracy] of a masked-LM-only model (HF BertForMaskedLM)
    on MLM + NSP micro-batches: ``labels`` (MLM labels, NSP labels), the NSP labels unused."""

    def metrics(logits, labels) -> torch.Tensor:
        return torch.stack([loss_fn(logits, labels).float(), vocab_parallel_cross_entropy(logits, labels[0], tp_group),
                            mlm_accuracy(logits, labels[0], tp_group)])

    return metrics


def bert_metrics(mlm_family: bool, hf_architecture: str | None, engine: TrainEngine, tp_group=None):
    """(per-micro-batch metrics, their names) of a BERT run's evaluations, or None: our BERT and HF
    BertForPreTraining `mlm_metrics`, HF BertForMaskedLM `masked_lm_metrics`; only engines with
    ``eval_metrics`` (ours) compute them."""
    if not hasattr(engine, "eval_metrics"):
        return None
    if mlm_family or hf_architecture == "BertForPreTraining":
        return mlm_metrics(engine.loss_fn, tp_group), MLM_METRICS
    if hf_architecture == "BertForMaskedLM":
        return masked_lm_metrics(engine.loss_fn, tp_group), MASKED_LM_METRICS
    return None


def validation_row(engine: TrainEngine, data, batches: int, metrics=None) -> dict:
    """The metrics row's validation fields over the held-out split's first ``batches`` global batches:
    ``val_loss``, ``val_ppl`` and, with ``metrics`` (`bert_metrics`: the function and its names), those."""
    held_out = data.held_out()
    if metrics is None:
        values = {"val_loss": [engine.eval_batch(held_out) for _ in range(batches)]}
    else:
        fn, names = metrics
        rows = [engine.eval_metrics(held_out, fn, len(names)) for _ in range(batches)]
        values = {name: [r[i] for r in rows] for i, name in enumerate(names)}
    row = {name: math.fsum(v) / len(v) for name, v in values.items()}
    nll = row.get("val_mlm_loss", row["val_loss"])
    row["val_ppl"] = math.exp(nll) if nll < 700 else math.inf
    return row
