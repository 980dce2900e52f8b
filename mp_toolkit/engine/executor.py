"""Run one rank's list of schedule actions for one global batch.

The executor knows actions, not schedules (DESIGN.md invariant 4): each action kind has one
handler, and a run of consecutive communication actions becomes one batched p2p call. Whatever
order a generator chose, this code runs it as written.

State per (stage, micro-batch) lives only between its F and its B: the stage's inputs (leaves that
collect the input gradient), its outputs (the graph to differentiate), and, on the last stage, the
micro-batch loss already divided by the number of micro-batches (invariant 5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mp_toolkit.layers import StageModule
from mp_toolkit.parallel.p2p import P2P, TensorSpec, as_tuple
from mp_toolkit.schedule import Action, Kind

MicroBatch = tuple  # (inputs: Tensor | tuple[Tensor, ...], labels: Tensor)


def _float_parts(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The differentiable tensors of a message; ints and bools travel without gradients."""
    return [t for t in tensors if t.is_floating_point()]


class Executor:
    """Executes actions for the stages this rank holds.

    Args:
        stages: stage index -> StageModule held by this rank.
        stage_to_rank: rank of every stage of the pipeline.
        rank: this process's global rank.
        p2p: transport for messages to other ranks.
        input_specs: stage index -> specs of the message that stage receives (agreed once).
        loss_fn: (last stage output, labels) -> scalar loss of one micro-batch.
    """

    def __init__(self, stages: dict[int, StageModule], stage_to_rank: Sequence[int], rank: int,
                 p2p: P2P | None, input_specs: dict[int, list[TensorSpec]], loss_fn: Callable):
        self.stages, self.stage_to_rank, self.rank = stages, tuple(stage_to_rank), rank
        self.p2p, self.input_specs, self.loss_fn = p2p, input_specs, loss_fn
        self.last_stage = len(self.stage_to_rank) - 1
        self.handlers = {Kind.F: self._forward, Kind.B: self._backward}

    def run(self, actions: Sequence[Action], microbatches: Sequence[MicroBatch],
            loss_divisor: int = 1, grad: bool = True) -> list[torch.Tensor]:
        """Run ``actions``; return the scaled losses of the micro-batches (last stage only).

        ``loss_divisor`` divides each micro-batch loss before backward (m, for accumulation).
        ``grad=False`` runs forward-only actions under no_grad (evaluation).
        """
        self._mbs, self._div, self._grad = microbatches, loss_divisor, grad
        self._inputs: dict = {}
        self._outputs: dict = {}
        self._grads: dict = {}
        self._losses: dict = {}
        i = 0
        with torch.set_grad_enabled(grad):
            while i < len(actions):
                j = i
                while j < len(actions) and actions[j].kind.is_comm:
                    j += 1
                if j > i:
                    self._communicate(actions[i:j])
                    i = j
                    continue
                handler = self.handlers.get(actions[i].kind)
                if handler is None:
                    raise NotImplementedError(f"action kind {actions[i].kind.value} ({actions[i]}) is not supported by this executor")
                handler(actions[i])
                i += 1
        if self.p2p is not None:
            self.p2p.wait_sends()
        return [self._losses[k] for k in sorted(self._losses)]

    # --- compute -----------------------------------------------------------------------------
    def _stage_inputs(self, stage: int, mb: int) -> tuple[torch.Tensor, ...]:
        if stage == 0:
            return as_tuple(self._mbs[mb][0])
        received = self._inputs.pop((stage, mb))
        # Received activations become leaves so their gradient can be sent back.
        return tuple(t.detach().requires_grad_(self._grad and t.is_floating_point()) for t in received)

    def _forward(self, a: Action) -> None:
        inputs = self._stage_inputs(a.stage, a.microbatch)
        outputs = as_tuple(self.stages[a.stage](*inputs))
        if a.stage == self.last_stage:
            loss = self.loss_fn(outputs[0], self._mbs[a.microbatch][1]) / self._div
            self._losses[a.microbatch] = loss
        self._outputs[(a.stage, a.microbatch)] = (inputs, outputs)

    def _backward(self, a: Action) -> None:
        inputs, outputs = self._outputs.pop((a.stage, a.microbatch))
        if a.stage == self.last_stage:
            loss = self._losses[a.microbatch]
            self._losses[a.microbatch] = loss.detach()
            loss.backward()
        else:
            grads = self._grads.pop((a.stage, a.microbatch))
            pairs = [(o, g) for o, g in zip(_float_parts(outputs), grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if a.stage > 0:
            self._grads[("send", a.stage, a.microbatch)] = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t) for t in _float_parts(inputs)
            )

    # --- communication -----------------------------------------------------------------------
    def _communicate(self, comms: Sequence[Action]) -> None:
        sends, recvs, recv_keys = [], [], []
        for a in comms:
            s, k = a.stage, a.microbatch
            if a.kind is Kind.SEND_F:
                sends.append((s + 1, self._outputs[(s, k)][1]))
            elif a.kind is Kind.SEND_B:
                sends.append((s - 1, self._grads.pop(("send", s, k))))
            elif a.kind is Kind.RECV_F:
                recvs.append((s - 1, self.input_specs[s]))
                recv_keys.append(("F", s, k))
            elif a.kind is Kind.RECV_B:
                specs = [TensorSpec.of(t) for t in _float_parts(self._outputs[(s, k)][1])]
                recvs.append((s + 1, specs))
                recv_keys.append(("B", s, k))
        remote_sends = []
        for peer_stage, tensors in sends:
            if self.stage_to_rank[peer_stage] == self.rank:
                raise NotImplementedError("sends between stages on one rank are not supported yet")
            remote_sends.append((self.stage_to_rank[peer_stage], tensors))
        remote_recvs = [(self.stage_to_rank[peer], specs) for peer, specs in recvs]
        received = self.p2p.exchange(remote_sends, remote_recvs)
        for (direction, s, k), message in zip(recv_keys, received):
            if direction == "F":
                self._inputs[(s, k)] = message
            else:
                self._grads[(s, k)] = message


def agree_specs(stages: dict[int, StageModule], stage_to_rank: Sequence[int], rank: int,
                p2p: P2P | None, first_inputs) -> dict[int, list[TensorSpec]]:
    """Learn, once, the shapes and dtypes each stage receives: the engine's shape pass.

    Stages run in pipeline order on one sample micro-batch under no_grad, each sending its output
    specs to the next stage's rank; a receiving stage runs on zeros of those specs. The RNG state
    is forked so the pass changes nothing that training will see (dropout masks included).
    """
    specs: dict[int, list[TensorSpec]] = {}
    carried = None
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
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
                inputs = tuple(torch.zeros(sp.shape, dtype=sp.dtype, device=p2p_device(p2p, first_inputs)) for sp in specs[s])
            carried = as_tuple(stages[s](*inputs))
            nxt = s + 1
            if nxt < len(stage_to_rank) and stage_to_rank[nxt] != rank:
                p2p.send_specs(stage_to_rank[nxt], carried)
    return specs


def p2p_device(p2p: P2P | None, sample) -> torch.device:
    return p2p.device if p2p is not None else as_tuple(sample)[0].device
