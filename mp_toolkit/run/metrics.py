"""Rank 0's per-step record of `mpt train`: JSON lines, progress bar, loss plot, summary line."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mp_toolkit.parallel.context import ParallelContext, grid_coords
from mp_toolkit.run.config import ConfigError, TrainConfig
from mp_toolkit.run.loggers import ScalarLogs
from mp_toolkit.user_files import write_output, writing


class MetricsLog:
    """Rank 0's per-step record: JSON lines, progress bar, loss plot.

    A run resumed at ``start_step`` keeps the metrics file's rows up to that step (a later save that
    was lost is trained again, so its rows are replaced) and appends the new ones; a torn last line
    (the run was killed while writing it) is dropped. Each row carries ``time``, the Unix time at the
    end of its step (tools/chaos.py measures recoveries with it).
    """

    def __init__(self, cfg: TrainConfig, enabled: bool, start_step: int = 0):
        self.cfg, self.enabled, self.rows, self.earlier = cfg, enabled, [], []
        self.last_val: dict | None = None  # the latest row with a validation loss
        self.failed: ConfigError | None = None  # a per-step write that failed (rank 0)
        self.file = None
        metrics = cfg.logging.metrics
        if enabled and metrics:
            with writing("--metrics", metrics):
                if start_step > 0 and Path(metrics).is_file():
                    self.earlier = _keep_rows(Path(metrics), start_step)
                self.file = open(metrics, "a" if start_step > 0 else "w")
        self.scalars = ScalarLogs(cfg, start_step) if enabled else None  # TensorBoard, CSV, wandb
        self.bar = None
        if enabled and cfg.logging.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=cfg.steps, initial=start_step, desc="train", file=sys.stderr, dynamic_ncols=True)

    def note(self, text: str) -> None:
        """A line for the user (rank 0), kept clear of the progress bar."""
        if not self.enabled:
            return
        if self.bar:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def step(self, row: dict) -> None:
        """Record ``row``: a write that fails (a full disk) is kept in ``failed`` and ends the writing; the
        loop then stops every rank with its line (`agree`)."""
        if not self.enabled:
            return
        self.rows.append(row)
        if self.failed is None:
            try:
                self._write(row)
            except ConfigError as e:
                self.failed = e
        if "val_loss" in row:
            self.last_val = row
        if self.bar:
            val = {"val_loss": f"{self.last_val['val_loss']:.4f}"} if self.last_val else {}
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", **val, tok_s=f"{row['tokens_per_s']:.0f}")
            self.bar.update(1)
        elif "val_loss" in row:  # no bar (--no-progress): a line per evaluation
            print(f"step {row['step']}: loss {row['loss']:.4f}, {validation_text(row)}", flush=True)

    def _write(self, row: dict) -> None:
        if self.file:
            with writing("--metrics", self.cfg.logging.metrics):
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()
        self.scalars.write(row)

    @property
    def writes_files(self) -> bool:
        """The run writes per-step files (the same on every rank: it is the run's config)."""
        log = self.cfg.logging
        return bool(log.metrics or log.csv or log.tensorboard)

    def rewind(self, step: int) -> None:
        """The rows after ``step`` are dropped (the run went back to its checkpoint, `run.spikes`)."""
        if not self.enabled:
            return
        self.rows = [r for r in self.rows if r["step"] <= step]
        if self.file:
            with writing("--metrics", self.cfg.logging.metrics):
                self.file.close()
                _keep_rows(Path(self.cfg.logging.metrics), step)
                self.file = open(self.cfg.logging.metrics, "a")
        self.scalars.close()
        self.scalars = ScalarLogs(self.cfg, step)
        if self.bar:
            self.bar.n = step
            self.bar.refresh()

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar:
            self.bar.close()
        if self.file:
            with writing("--metrics", self.cfg.logging.metrics):
                self.file.close()
        self.scalars.close()
        if not self.rows:
            return
        if self.cfg.logging.plot:
            plot_losses(self.earlier + self.rows, self.cfg.logging.plot)
        first, last = self.rows[0], self.rows[-1]
        timed = self.rows[1:] or self.rows  # the first step includes the shape pass (of its lengths)
        tok_s = sum(r["tokens_per_s"] for r in timed) / len(timed)
        skipped = sum(bool(r.get("skipped")) for r in self.rows)
        print(f"loss {first['loss']:.4f} -> {last['loss']:.4f} over {len(self.rows)} steps, "
              f"{tok_s:.0f} tokens/s, {skipped} skipped, loss scale {last['loss_scale']:g}")
        if "peak_rss_bytes" in last:  # per rank, from process start: imports, build, load and steps
            print("  peak resident memory per rank: " + ", ".join(
                f"{b / 2**20:.0f} MiB" for b in last["peak_rss_bytes"]) + " (steady-state steps above the "
                "post-import baseline: " + ", ".join(f"{b / 2**20:.0f}" for b in last["peak_memory_bytes"]) + " MiB; "
                "built and loaded, before the first step: "
                + ", ".join(f"{b / 2**20:.0f}" for b in last.get("peak_load_rss_bytes", [])) + " MiB)")
            planned = last.get("planned_memory_bytes", [])
            if planned and all(planned):
                print("  mpt plan predicts for the steps: " + ", ".join(f"{b / 2**20:.0f}" for b in planned)
                      + " MiB (measured / predicted: " + ", ".join(
                          f"{m / p:.2f}" for m, p in zip(last["peak_memory_bytes"], planned)) + ")")
        if self.last_val is not None:
            print(f"  {validation_text(self.last_val)} after step {self.last_val['step']}")
        for t in last.get("trust_ratio", []):
            print(f"  stage {t['stage']} trust ratio ({t['rule']} rule, {t['tensors']} tensors) min {t['min']:.4g} "
                  f"median {t['median']:.4g} max {t['max']:.4g}")
        log = self.cfg.logging
        if log.metrics:
            print(f"metrics: {log.metrics}")
        if log.plot:
            print(f"loss plot: {log.plot}")
        for what, where in (("tensorboard", log.tensorboard), ("csv", log.csv)):
            if where is not None:
                print(f"{what}: {where}")


def validation_text(row: dict) -> str:
    """"validation loss 2.1234 (perplexity 8.37)", and BERT's MLM / NSP losses and MLM accuracy."""
    parts = [f"{label} {row[key]:.4f}" for key, label in (("val_mlm_loss", "MLM loss"), ("val_nsp_loss", "NSP loss"),
                                                         ("val_mlm_accuracy", "MLM accuracy")) if key in row]
    return f"validation loss {row['val_loss']:.4f} (perplexity {row['val_ppl']:.2f})" + "".join(f", {p}" for p in parts)


def _keep_rows(path: Path, step: int) -> list[dict]:
    """Rewrite the metrics file ``path`` with its rows up to ``step``; returns them."""
    kept = [(line, row) for line in path.read_text().splitlines() if (row := _row(line)) is not None
            and row["step"] <= step]
    path.write_text("".join(line + "\n" for line, _ in kept))
    return [row for _, row in kept]


def _row(line: str) -> dict | None:
    """One metrics row, or None for a blank or torn line."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def gather_ints(value: int, device: torch.device | None = None) -> list[int]:
    """``value`` of every rank, in rank order (a plain list on one process); ``device`` is where the
    backend communicates (CUDA under NCCL)."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    if not dist.is_initialized():
        return [value]
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [int(r.item()) for r in rows]


class DrawnTokens:
    """The micro-batches an engine draws from ``data``, counting their tokens (the elements of each
    micro-batch's first tensor, its input ids): under --length-buckets a step's tokens vary."""

    def __init__(self, data):
        self.data, self.tokens = data, 0

    def __iter__(self) -> "DrawnTokens":
        return self

    def __next__(self):
        batch = next(self.data)
        self.tokens += batch[0].numel()
        return batch


def global_batch_tokens(drawn: int, ctx: ParallelContext) -> int:
    """The tokens of one global batch from every rank's ``drawn`` count (a collective): the ranks of
    one replica that read data (its stages, its tp ranks) read the same micro-batches, so a replica
    counts once (the largest of its ranks' counts: a stage that reads none counts 0); replicas add up."""
    per_replica = [0] * ctx.dp
    for rank, count in enumerate(gather_ints(drawn, ctx.device)):
        dp_rank = grid_coords(rank, ctx.pp, ctx.tp, ctx.dp, ctx.cp)[2]
        per_replica[dp_rank] = max(per_replica[dp_rank], count)
    return sum(per_replica)


def plot_losses(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="training loss")
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()  # the learning rate on its own scale, right
    lr_ax.plot([r["step"] for r in rows], [r["lr"] for r in rows], color="tab:gray", linestyle=":",
               label="learning rate")
    lr_ax.set_ylabel("learning rate")
    handles = ax.get_legend_handles_labels()[0] + lr_ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=120, format=os.path.splitext(os.fspath(path))[1][1:].lower() or "png")
    finally:
        plt.close(fig)
    write_output("--plot", path, image.getvalue())
