"""The engine's shape pass: what each stage receives, agreed once per shape of the input.

A stage that receives its input from another rank must post a receive buffer of the right shape
and dtype before the data arrives, so the ranks of a pipeline agree beforehand on every message:
the *shape pass* (`agree_specs`) runs the stages in pipeline order on one sample micro-batch,
each rank telling the next stage's rank the specs of what it will send.

Micro-batches may differ in length within a run and across runs (issue 21 item 3: BERT's 128 then
512 phases, bucketed fine-tuning data). Every rank of a data-parallel replica -- its pp and tp
ranks -- reads the same micro-batches in the same order (`mp_toolkit.data.lm.MicroBatches`;
`PipelineEngine.train_batch`'s contract), so each rank can key the specs by the *first stage's
input* specs of a micro-batch (`shape_key`) locally: all ranks of the pipeline meet a new key in
the same micro-batch, and run the collective pass for it together, in the same order
(`ShapePass.for_batch` walks the micro-batches in order before the schedule starts). Known keys
cost a dictionary lookup and no message.

Assumption, as in DeepSpeed's ``dynamic_shape`` and torch.distributed.pipelining: what a stage
sends depends on the shapes and dtypes of the first stage's inputs, not on their values (true of
our GPT and BERT and of the HF layer lists; a model that drops padded rows or routes tokens by value
would need the specs sent with every message).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mp_toolkit.layers import StageModule
from mp_toolkit.parallel.p2p import P2P, TensorSpec, as_tuple

ShapeKey = tuple[TensorSpec, ...]
StageSpecs = dict[int, list[TensorSpec]]  # stage -> specs of the message it receives


def shape_key(first_inputs) -> ShapeKey:
    """The key of a micro-batch: shapes and dtypes of the first stage's inputs."""
    return tuple(TensorSpec.of(t) for t in as_tuple(first_inputs))


def p2p_device(p2p: P2P | None, sample) -> torch.device:
    return p2p.device if p2p is not None else as_tuple(sample)[0].device


def agree_specs(stages: dict[int, StageModule], stage_to_rank: Sequence[int], rank: int,
                p2p: P2P | None, first_inputs) -> StageSpecs:
    """Learn the shapes and dtypes each stage receives for inputs shaped like ``first_inputs``.

    Stages run in pipeline order on the sample under no_grad, each sending its output specs to the
    next stage's rank; a receiving stage runs on zeros of those specs. Every rank of the pipeline
    calls this with an equally shaped sample at the same point (it is collective over the
    pipeline, and over each stage's tp group through the stage's own collectives). The random
    state (CPU, and the device's where it is CUDA) is forked so the pass changes nothing that
    training will see (dropout masks included).
    """
    specs: StageSpecs = {}
    carried = None
    device = p2p_device(p2p, first_inputs)
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for s in range(len(stage_to_rank)):
            owner = stage_to_rank[s]
            if s > 0 and owner == rank and stage_to_rank[s - 1] != rank:
                specs[s] = p2p.recv_specs(stage_to_rank[s - 1])
            if owner != rank:
                continue
            if s == 0:
                inputs = as_tuple(first_inputs)
            else:
                if s not in specs:  # the previous stage ran on this rank
                    specs[s] = [TensorSpec.of(t) for t in carried]
                inputs = tuple(torch.zeros(sp.shape, dtype=sp.dtype, device=device) for sp in specs[s])
            carried = as_tuple(stages[s](*inputs))
            nxt = s + 1
            if nxt < len(stage_to_rank) and stage_to_rank[nxt] != rank:
                p2p.send_specs(stage_to_rank[nxt], carried)
    return specs


class ShapePass:
    """`agree_specs` per shape key, cached for the engine's life (one entry per distinct length).

    ``passes`` counts the shape passes run (one per key met), for tests and the profile.
    """

    def __init__(self, stages: dict[int, StageModule], stage_to_rank: Sequence[int], rank: int, p2p: P2P | None):
        self.stages, self.stage_to_rank, self.rank, self.p2p = stages, tuple(stage_to_rank), rank, p2p
        self.cache: dict[ShapeKey, StageSpecs] = {}
        self.passes = 0
        # one rank holds the whole pipeline (pp 1): nothing is received, nothing to agree
        self.needed = len(set(self.stage_to_rank)) > 1

    def specs(self, first_inputs) -> StageSpecs:
        """What each stage receives for a micro-batch whose first-stage inputs are ``first_inputs``."""
        if not self.needed:
            return {}
        key = shape_key(first_inputs)
        found = self.cache.get(key)
        if found is None:
            found = self.cache[key] = agree_specs(self.stages, self.stage_to_rank, self.rank, self.p2p, first_inputs)
            self.passes += 1
        return found

    def for_batch(self, microbatches: Sequence) -> list[StageSpecs]:
        """The specs of every micro-batch ``(inputs, labels)``, in order: new keys are agreed here,
        before the schedule runs, so no pass interleaves with the schedule's messages."""
        return [self.specs(inputs) for inputs, _ in microbatches]
