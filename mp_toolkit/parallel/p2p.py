"""Point-to-point transport between pipeline stages: batched isend/irecv of tensor tuples.

Messages are tuples of tensors. Shapes and dtypes are agreed once per shape of the input (see
`send_specs` / `recv_specs`, used by the engine's shape pass, `mp_toolkit.engine.shapes`) and
cached by the caller, so a steady-state step sends only payload. Integer and bool tensors travel
as they are (bool as uint8 bytes) and never carry gradients.

All the transfers of one run of consecutive communication actions go into a single
`torch.distributed.batch_isend_irecv` call, so a send to a peer and a receive from the same peer
cannot deadlock each other under NCCL (Megatron's ``send_forward_recv_backward``). `exchange` waits
for its receives at once; `post` returns them as `Received` handles, waited for when the data is
needed (the executor posts a batch's receives one batch ahead where `posts_ahead` allows it, so
the transfer overlaps the compute in between). Sends are waited for by `wait_sends`: all of them
at the end of the step, or, during it, those the caller names once it knows their receive has been
posted (the executor freeing sent outputs, `mp_toolkit.schedule.completion`), so a send never
blocks the compute that follows it.

Receive buffers come from `RecvBuffers`: allocated once per shape and dtype and reused, a buffer
only once nothing else holds its memory (issue 23 item 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
_META_LEN = 64  # int64 words: [count, (dtype code, ndim, *shape) per tensor]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of a message."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), t.dtype)


def as_tuple(x) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def encode_specs(specs: list[TensorSpec]) -> torch.Tensor:
    words = [len(specs)]
    for s in specs:
        words += [_DTYPES.index(s.dtype), len(s.shape), *s.shape]
    if len(words) > _META_LEN:
        raise ValueError(f"message of {len(specs)} tensors is too large to describe in {_META_LEN} words")
    return torch.tensor(words + [0] * (_META_LEN - len(words)), dtype=torch.int64)


def decode_specs(meta: torch.Tensor) -> list[TensorSpec]:
    words, specs, i = meta.tolist(), [], 1
    for _ in range(words[0]):
        dtype, ndim = _DTYPES[words[i]], words[i + 1]
        specs.append(TensorSpec(tuple(words[i + 2:i + 2 + ndim]), dtype))
        i += 2 + ndim
    return specs


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The buffer that travels: contiguous, bool viewed as bytes."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _storage_holders(t: torch.Tensor) -> int:
    """Tensors (and storage objects) holding ``t``'s memory, less the temporary one asked here."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


class RecvBuffers:
    """Receive buffers allocated once per (shape, dtype) and reused (issue 23 item 3).

    The pool keeps every buffer it allocated and hands out an alias of it (a view: another tensor
    over the same memory). A buffer is reused only when its memory is held by the pool's own tensor
    alone: no alias handed out is alive -- not the received message, not the detached leaf the
    next stage computed from, not a tensor autograd saved for the backward, not a view of it that
    became a gradient, not an irecv in flight. Anything that still reads the bytes holds them, so
    reuse cannot overwrite data in use; otherwise a new buffer is allocated. The pool then holds,
    per shape, as many buffers as were ever alive at once (the receives in flight of a schedule).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pools: dict[tuple, list[torch.Tensor]] = {}
        self.allocated = 0  # buffers made
        self.reused = 0  # receives served by an existing buffer

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``shape`` and ``dtype`` that nothing else holds, as a fresh alias."""
        pool = self.pools.setdefault((tuple(shape), dtype), [])
        for buf in pool:
            if _storage_holders(buf) == 1:
                self.reused += 1
                return buf.view(buf.shape)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        pool.append(buf)
        self.allocated += 1
        return buf.view(buf.shape)

    @property
    def bytes(self) -> int:
        """Memory the pool holds."""
        return sum(b.untyped_storage().nbytes() for pool in self.pools.values() for b in pool)


class Received:
    """A posted receive: ``wait()`` waits for its transfer (once) and returns the message."""

    def __init__(self, works: list, message: tuple[torch.Tensor, ...], finish=None):
        self._works, self._message, self._finish = works, message, finish

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self._works is not None:
            for work in self._works:
                work.wait()
            self._works = None
            if self._finish is not None:
                self._message = self._finish(self._message)
        return self._message


class P2P:
    """Batched point-to-point calls for one rank; size-1 worlds never get here."""

    def __init__(self, device: torch.device, group=None):
        self.device, self.group = device, group
        self._pending: list = []  # (key, work, buffer) of posted sends
        self.bytes_sent = 0
        self.recv_buffers = RecvBuffers(device)

    @property
    def posts_ahead(self) -> bool:
        """Whether a receive may be posted before the sends that precede it in the schedule. gloo
        runs each operation on its own; NCCL queues a communicator's operations on one stream, where
        an early receive would hold back the sends queued after it (a deadlock when the peer needs
        one of them first), so there receives are posted where the schedule puts them."""
        return dist.get_backend(self.group) == "gloo"

    def exchange(self, sends: list[tuple[int, tuple[torch.Tensor, ...]]],
                 recvs: list[tuple[int, list[TensorSpec]]],
                 send_keys: list | None = None) -> list[tuple[torch.Tensor, ...]]:
        """`post`, then wait for every receive: the received tuples in order."""
        return [r.wait() for r in self.post(sends, recvs, send_keys)]

    def post(self, sends: list[tuple[int, tuple[torch.Tensor, ...]]],
             recvs: list[tuple[int, list[TensorSpec]]],
             send_keys: list | None = None) -> list[Received]:
        """Post every send and receive in one batch; return the receives, in order, not waited for.

        sends: (peer rank, tensors); recvs: (peer rank, specs of the tensors expected);
        send_keys: a name per send for `wait_sends` (default None).
        """
        ops, buffers, out = [], [], []
        for (peer, tensors), key in zip(sends, send_keys or [None] * len(sends)):
            for t in tensors:
                buf = _wire(t.detach())
                buffers.append((key, buf))
                self.bytes_sent += buf.numel() * buf.element_size()
                ops.append(dist.P2POp(dist.isend, buf, peer, self.group))
        for peer, specs in recvs:
            message = []
            for spec in specs:
                wire_dtype = torch.uint8 if spec.dtype == torch.bool else spec.dtype
                buf = self.recv_buffers.take(spec.shape, wire_dtype)
                ops.append(dist.P2POp(dist.irecv, buf, peer, self.group))
                message.append(buf.view(torch.bool) if spec.dtype == torch.bool else buf)
            out.append(tuple(message))
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        n_send = len(buffers)
        for work, (key, buf) in zip(works[:n_send], buffers):
            self._pending.append((key, work, buf))  # keep the buffer alive until the send completes
        received, i = [], n_send
        for message in out:
            received.append(Received(works[i:i + len(message)], message))
            i += len(message)
        return received

    def wait_sends(self, keys=None) -> None:
        """Wait for the posted sends named by ``keys`` (all when None) and drop their buffers.

        Only name a send whose matching receive is known to be posted: gloo sends rendezvous, so
        waiting on any other could deadlock a schedule that is safe under non-blocking sends.
        """
        keep = []
        for key, work, buf in self._pending:
            if keys is None or key in keys:
                work.wait()
            else:
                keep.append((key, work, buf))
        self._pending = keep

    def send_specs(self, peer: int, tensors: tuple[torch.Tensor, ...]) -> None:
        """Tell ``peer`` the shapes and dtypes of a message (blocking; used once per channel)."""
        dist.send(encode_specs([TensorSpec.of(t) for t in tensors]).to(self.device), peer, self.group)

    def recv_specs(self, peer: int) -> list[TensorSpec]:
        meta = torch.empty(_META_LEN, dtype=torch.int64, device=self.device)
        dist.recv(meta, peer, self.group)
        return decode_specs(meta.cpu())
