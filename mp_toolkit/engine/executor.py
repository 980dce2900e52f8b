"""Run one rank's list of schedule actions for one global batch.

The executor knows actions, not schedules (DESIGN.md invariant 4): each action kind has one
handler, and a run of consecutive communication actions becomes one batched p2p call. Whatever
order a generator chose, this code runs it as written.

State per (stage, micro-batch) lives only between its F and its B: the stage's inputs (leaves that
collect the input gradient), its outputs (the graph to differentiate), and, on the last stage, the
micro-batch loss already divided by the number of micro-batches (invariant 5). An output sent to
another rank keeps its graph but, once the send has completed, not its storage
(`mp_toolkit.engine.free_sent`); the backward therefore starts from the outputs' gradient edges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from mp_toolkit.engine.free_sent import releasable, release
from mp_toolkit.engine.shapes import ShapePass, StageSpecs
from mp_toolkit.engine.split_backward import split_backward_input
from mp_toolkit.layers import StageModule
from mp_toolkit.parallel.p2p import P2P, Received, TensorSpec, as_tuple
from mp_toolkit.schedule import Action, Kind
from mp_toolkit.schedule.completion import comm_batches

MicroBatch = tuple  # (inputs: Tensor | tuple[Tensor, ...], labels: Tensor)


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return grad if grad is not None else torch.zeros_like(like)


def _float_parts(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The differentiable tensors of a message; ints and bools travel without gradients."""
    return [t for t in tensors if t.is_floating_point()]


def final_weight_grad_actions(actions: Sequence[Action]) -> dict[int, int]:
    """{index of a stage's last weight-gradient action (B, or W when split) in ``actions``: stage}.

    Read off the action list, whatever schedule wrote it (I actions leave weight gradients alone).
    """
    last = {a.stage: i for i, a in enumerate(actions) if a.kind in (Kind.B, Kind.W)}
    return {i: stage for stage, i in last.items()}


class Executor:
    """Executes actions for the stages this rank holds.

    Args:
        stages: stage index -> StageModule held by this rank.
        stage_to_rank: rank of every stage of the pipeline.
        rank: this process's global rank.
        p2p: transport for messages to other ranks.
        shapes: the engine's shape pass (`mp_toolkit.engine.shapes`): what each stage receives,
            per micro-batch, agreed once per shape of the first stage's inputs.
        loss_fn: (last stage output, labels) -> scalar loss of one micro-batch.
        free_sent_outputs: free the storage of a stage output sent to another rank once its send
            has completed, keeping its graph for the backward (`mp_toolkit.engine.free_sent`
            says which outputs qualify); ``run`` needs ``send_waits`` to know when. Default True;
            False keeps every output whole until its backward (the comparison of
            ``tools/bench_memory.py --no-free-sent``).
        post_ahead: post each comm batch's receives with the batch before it, where the transport
            allows (``p2p.posts_ahead``: gloo), and wait for a message only when the action that
            reads it runs, so the transfer overlaps the compute in between. Default True.
    """

    def __init__(self, stages: dict[int, StageModule], stage_to_rank: Sequence[int], rank: int,
                 p2p: P2P | None, shapes: ShapePass, loss_fn: Callable,
                 free_sent_outputs: bool = True, post_ahead: bool = True):
        self.stages, self.stage_to_rank, self.rank = stages, tuple(stage_to_rank), rank
        self.p2p, self.shapes, self.loss_fn = p2p, shapes, loss_fn
        self.input_specs: list[StageSpecs] = []  # per micro-batch of the last run: stage -> what it receives
        self.free_sent_outputs = free_sent_outputs
        self.post_ahead = post_ahead and p2p is not None and p2p.posts_ahead
        self.posted_ahead = 0  # receives posted with the batch before theirs, over the executor's life
        self.freed_bytes = 0  # storage released by the last run (what free_sent_outputs saved)
        self.last_stage = len(self.stage_to_rank) - 1
        self.handlers = {Kind.F: self._forward, Kind.B: self._backward,
                         Kind.I: self._backward_input, Kind.W: self._backward_weight}

    def run(self, actions: Sequence[Action], batches: Sequence[MicroBatch],
            microbatches: int = 1, loss_scale: float = 1.0, grad: bool = True,
            on_grads_final: Callable[[int], None] | None = None,
            send_waits: dict[int, list[int]] | None = None) -> list[torch.Tensor]:
        """Run ``actions`` over ``batches`` (the global batch's micro-batches); return the losses /
        ``microbatches`` of the micro-batches (last stage only).

        ``microbatches`` (the micro-batch count m of the step) divides each micro-batch loss before
        backward (gradient accumulation, DESIGN.md invariant 5);
        ``loss_scale`` multiplies the loss that is differentiated (fp16 loss scaling), not the
        one returned.
        ``grad=False`` runs forward-only actions under no_grad (evaluation).
        ``on_grads_final(stage)`` is called right after a stage's last weight-gradient action of
        this batch (`final_weight_grad_actions`): from then on its gradients no longer change, so
        the data-parallel all-reduce of that stage can start while the rest of the schedule runs.
        ``send_waits`` ({position of a comm run's last action: positions of forward sends to wait
        for after it}, `mp_toolkit.schedule.completion.send_waits`) says when a sent output's send
        can be waited for without risk of deadlock, and the output then freed; without it, no
        output is freed.
        """
        final = final_weight_grad_actions(actions) if on_grads_final is not None else {}
        # every rank of the pipeline walks the same micro-batches here, so new shapes are agreed together
        self.input_specs = self.shapes.for_batch(batches)
        self._mbs, self._div, self._scale, self._grad = batches, microbatches, loss_scale, grad
        self._inputs: dict = {}
        self._outputs: dict = {}
        self._grads: dict = {}
        self._losses: dict = {}
        self._deferred: dict = {}  # (stage, mb) -> what W differentiates, kept from I
        self._sent_specs: dict = {}  # (stage, mb) -> specs of its sent outputs, for RECV_B
        self._to_free: dict = {}  # position of a SEND_F -> (stage, mb) whose outputs may be freed
        self._wait_plan = send_waits if self.free_sent_outputs else None
        self._batches = comm_batches(actions)  # (first, last) position of each run of comm actions
        self._ahead: dict = {}  # ("F" | "B", stage, mb) -> Received, posted with an earlier batch
        self.freed_bytes = 0
        i = 0
        with torch.set_grad_enabled(grad):
            while i < len(actions):
                j = i
                while j < len(actions) and actions[j].kind.is_comm:
                    j += 1
                if j > i:
                    self._communicate(actions, i, j)
                    i = j
                    continue
                handler = self.handlers.get(actions[i].kind)
                if handler is None:
                    raise NotImplementedError(f"action kind {actions[i].kind.value} ({actions[i]}) "
                                              "is not supported by this executor")
                self._await(actions[i])
                handler(actions[i])
                if i in final:
                    on_grads_final(final[i])
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
        s, k = a.stage, a.microbatch
        inputs = self._stage_inputs(s, k)
        outputs = as_tuple(self.stages[s](*inputs))
        if s == self.last_stage:
            # the loss and its softmax in fp32 under mixed precision
            out = tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in outputs)
            # one output (GPT's logits) or all of them (BERT's mlm_logits, nsp_logits)
            self._losses[k] = self.loss_fn(out[0] if len(out) == 1 else out, self._mbs[k][1]) / self._div
            outputs = None  # the loss holds the graph; keeping the (B, T, V) logits would cost N*V floats
        elif self._local(s + 1):  # the next stage is on this rank: hand the activations over
            self._inputs[(s + 1, k)] = outputs
        self._outputs[(s, k)] = (inputs, outputs)

    def _roots(self, s: int, k: int) -> tuple[list[torch.Tensor | GradientEdge], list[torch.Tensor] | None]:
        """What to differentiate for (stage, micro-batch): the scaled loss, or outputs and their grads."""
        if s == self.last_stage:
            loss = self._losses[k]
            self._losses[k] = loss.detach()
            return [loss * self._scale if self._scale != 1.0 else loss], None
        _, outputs = self._outputs[(s, k)]
        grads = self._grads.pop((s, k))
        # Gradient edges, not the tensors: torch.autograd checks a gradient against the edge's
        # recorded shape, which a freed output (one element now) no longer has.
        pairs = [(get_gradient_edge(o), g) for o, g in zip(_float_parts(outputs), grads) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _hand_back(self, s: int, k: int, input_grads: tuple[torch.Tensor, ...]) -> None:
        """Input gradients go to the previous stage: locally, or queued for SEND_B."""
        if s == 0:
            return
        key = (s - 1, k) if self._local(s - 1) else ("send", s, k)
        self._grads[key] = input_grads

    def _backward(self, a: Action) -> None:
        """Full backward (B): weight and input gradients in one pass."""
        s, k = a.stage, a.microbatch
        roots, grads = self._roots(s, k)
        inputs, _ = self._outputs.pop((s, k))
        if roots:
            torch.autograd.backward(roots, grads)
        self._hand_back(s, k, tuple(_or_zeros(t.grad, t) for t in _float_parts(inputs)))

    def _backward_input(self, a: Action) -> None:
        """I of zero-bubble schedules: input gradients only; W's share of the graph is kept for W
        (`mp_toolkit.engine.split_backward`)."""
        s, k = a.stage, a.microbatch
        roots, grads = self._roots(s, k)
        inputs, _ = self._outputs[(s, k)]
        leaves = [t for t in _float_parts(inputs) if t.requires_grad]
        got, weight_pass = split_backward_input(roots, grads, leaves, self._params(s))
        by_leaf = dict(zip(map(id, leaves), got))
        self._hand_back(s, k, tuple(_or_zeros(by_leaf.get(id(t)), t) for t in _float_parts(inputs)))
        self._deferred[(s, k)] = (roots, grads, weight_pass)

    def _backward_weight(self, a: Action) -> None:
        """W of zero-bubble schedules: weight gradients, accumulated in micro-batch order."""
        s, k = a.stage, a.microbatch
        roots, grads, weight_pass = self._deferred.pop((s, k))
        self._outputs.pop((s, k))
        if weight_pass is not None:
            weight_pass.run()
            return
        params = self._params(s)  # no split (the first stage): the whole backward, towards the weights only
        if roots and params:
            torch.autograd.backward(roots, grads, inputs=params)

    def _params(self, stage: int) -> list[torch.nn.Parameter]:
        return [p for p in self.stages[stage].parameters() if p.requires_grad]

    def _local(self, stage: int) -> bool:
        return self.stage_to_rank[stage] == self.rank

    # --- communication -----------------------------------------------------------------------
    def _await(self, a: Action) -> None:
        """Wait for the message ``a`` reads, if it is still a posted receive (`Received`)."""
        store = self._inputs if a.kind is Kind.F else self._grads if a.kind in (Kind.B, Kind.I) else None
        key = (a.stage, a.microbatch)
        if store is not None and isinstance(store.get(key), Received):
            store[key] = store[key].wait()

    def _recv(self, a: Action) -> tuple[tuple, int, list[TensorSpec]] | None:
        """(key, peer stage, specs) of a receive action; None for a RECV_B whose output has not been
        sent yet (its specs are those of the sent output)."""
        s, k = a.stage, a.microbatch
        if a.kind is Kind.RECV_F:
            return ("F", s, k), s - 1, self.input_specs[k][s]
        if (s, k) not in self._sent_specs:
            return None
        return ("B", s, k), s + 1, self._sent_specs[(s, k)]

    def _posted_ahead(self, last: int, actions: Sequence[Action]) -> list[tuple[tuple, int, list[TensorSpec]]]:
        """The receives of the comm batch after the one ending at ``last`` that may be posted now:
        its leading receives whose specs are known. Each receive moves by at most one batch and in
        order, so the receives from each peer are posted in the schedule's order (gloo and NCCL
        pair a channel's messages in order, `mp_toolkit.schedule.completion._pairs`)."""
        nxt = next(((first, end) for first, end in self._batches if first > last), None)
        out = []
        if nxt is not None:
            for a in actions[nxt[0]:nxt[1] + 1]:
                if a.kind.is_recv:
                    recv = self._recv(a)
                    if recv is None:
                        break
                    out.append(recv)
        return out

    def _communicate(self, actions: Sequence[Action], first: int, end: int) -> None:
        """Run the comm actions at positions ``first .. end - 1`` as one batch (with, where the
        transport allows, the next batch's receives); received messages are stored as `Received`
        and waited for by the action that reads them (`_await`)."""
        sends, send_keys, recvs = [], [], []
        for pos in range(first, end):
            a = actions[pos]
            s, k = a.stage, a.microbatch
            if a.kind is Kind.SEND_F:
                outputs = self._outputs[(s, k)][1]
                self._sent_specs[(s, k)] = [TensorSpec.of(t) for t in _float_parts(outputs)]
                if self._wait_plan is not None and any(t.grad_fn is not None for t in outputs):
                    self._to_free[pos] = (s, k)
                sends.append((s + 1, outputs))
                send_keys.append(pos)
            elif a.kind is Kind.SEND_B:
                sends.append((s - 1, self._grads.pop(("send", s, k))))
                send_keys.append(pos)
            elif a.kind.is_recv:
                key = ("F" if a.kind is Kind.RECV_F else "B", s, k)
                if key in self._ahead:  # posted with the batch before
                    self._deliver(key, self._ahead.pop(key))
                else:
                    recvs.append(self._recv(a))
        new = {key for key, _, _ in recvs}
        if self.post_ahead:
            ahead = self._posted_ahead(end - 1, actions)
            self.posted_ahead += len(ahead)
            recvs += ahead
        for direction, s, k in (key for key, _, _ in recvs):
            if direction == "B":
                del self._sent_specs[(s, k)]  # read once, by its receive
        remote_sends = []
        for peer_stage, tensors in sends:
            if self.stage_to_rank[peer_stage] == self.rank:  # `schedule.validate` refuses such a schedule
                raise ValueError(f"a send to stage {peer_stage}, which is on this rank: neighbours on one rank "
                                 "hand over locally")
            remote_sends.append((self.stage_to_rank[peer_stage], tensors))
        remote_recvs = [(self.stage_to_rank[peer], specs) for _, peer, specs in recvs]
        received = self.p2p.post(remote_sends, remote_recvs, send_keys)
        for (key, _, _), message in zip(recvs, received):
            if key in new:
                self._deliver(key, message)
            else:
                self._ahead[key] = message
        if self._wait_plan is not None:
            self._free_sent(self._wait_plan.get(end - 1, ()))

    def _deliver(self, key: tuple, message) -> None:
        direction, s, k = key
        (self._inputs if direction == "F" else self._grads)[(s, k)] = message

    def _free_sent(self, waits: Sequence[int]) -> None:
        """Wait for the sends at positions ``waits`` (the plan guarantees their receives get
        posted without this rank's help), then free what `releasable` allows of their outputs."""
        done = [pos for pos in waits if pos in self._to_free]
        if not done:
            return
        self.p2p.wait_sends(set(done))  # drops the wire buffers, which shared the outputs' storage
        for pos in done:
            entry = self._outputs.get(self._to_free.pop(pos))
            if entry is None:  # its backward already ran
                continue
            for t in entry[1]:
                if releasable(t):
                    self.freed_bytes += release(t)
