"""The micro-batches a run's replica reads: ``--data`` through `mp_toolkit.data.feed`, with the ranks in step.

Shared by the model_zoo families (`mp_toolkit.run.families`) and ``--hf`` runs (`mp_toolkit.run.hf_family`).
"""

from __future__ import annotations

from mp_toolkit.data.feed import Fed, Wanted, feed
from mp_toolkit.data.lm import MicroBatches, SyntheticSamples, check_holdout, rank0_first
from mp_toolkit.parallel.agree import agree
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.run.config import TrainConfig


def feed_batches(cfg: TrainConfig, ctx: ParallelContext, rank: int, wanted: Wanted) -> tuple[MicroBatches, Fed | None]:
    """This replica's micro-batches of ``--data`` (`mp_toolkit.data.feed`): rank 0 prepares what is not prepared
    and builds the sample indices first, the other ranks then memory-map them. GPT's ``--data synthetic``
    draws random ids (no corpus)."""
    g = cfg.parallel.dp * cfg.batch.microbatches * cfg.batch.micro_batch
    if cfg.dataset.data == "synthetic" and not wanted.pairs:
        train, val = SyntheticSamples.split(wanted.vocab_size, cfg.batch.seq_len, cfg.seed, None,
                                            cfg.held_out_sequences)
        fed = None
    else:
        log = (lambda line: print(line, flush=True)) if rank == 0 else None
        def build() -> Fed:
            fed = feed(cfg.dataset.data, wanted, cfg.dataset.cache_dir, total=max(1, cfg.steps) * g, log=log)
            check_holdout(fed.validation, cfg.held_out_sequences)  # on rank 0 first: one line, not one per rank
            return fed

        fed = rank0_first(build, rank, lambda error: agree(error, ctx))
        train, val = fed.train, fed.validation
    data = MicroBatches(train, cfg.batch.micro_batch, dp_rank=ctx.dp_rank, dp_size=ctx.dp, seed=cfg.seed,
                        holdout=cfg.held_out_sequences, length_buckets=cfg.batch.bucket_lengths, validation=val,
                        digest=fed.digest if fed is not None else None,
                        tokenizer_digest=fed.tokenizer_digest if fed is not None else None)
    return data, fed
