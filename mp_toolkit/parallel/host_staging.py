"""Pipeline messages through host memory, for ranks that compute on CUDA over gloo.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so where a machine has fewer GPUs
than local ranks the launcher joins gloo instead (`mp_toolkit.run.launch.backend_for`). gloo
reduces and broadcasts CUDA tensors (through host copies of its own) but its point-to-point
calls take host memory only: `HostStagedP2P` copies each message to the host before it is sent
and each received one onto the compute device, around an ordinary `P2P` over host buffers. The
executor sees the compute device (`device`) as it would under NCCL.

    mpt train --model gpt-tiny --pp 2 ...   # on a one-GPU machine: 2 ranks on cuda:0, gloo between them
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mp_toolkit.parallel.p2p import P2P, Received, TensorSpec

HOST = torch.device("cpu")


class HostStagedP2P:
    """`P2P`'s calls, with the messages staged through host memory (``device`` computes)."""

    def __init__(self, device: torch.device, group=None):
        self.device = device
        self.wire = P2P(HOST, group)

    @property
    def bytes_sent(self) -> int:
        return self.wire.bytes_sent

    @property
    def posts_ahead(self) -> bool:
        return self.wire.posts_ahead  # gloo

    def exchange(self, sends: list[tuple[int, tuple[torch.Tensor, ...]]],
                 recvs: list[tuple[int, list[TensorSpec]]],
                 send_keys: list | None = None) -> list[tuple[torch.Tensor, ...]]:
        """`P2P.exchange` through host memory (`post`, every receive waited for)."""
        return [r.wait() for r in self.post(sends, recvs, send_keys)]

    def post(self, sends: list[tuple[int, tuple[torch.Tensor, ...]]],
             recvs: list[tuple[int, list[TensorSpec]]],
             send_keys: list | None = None) -> list[Received]:
        """`P2P.post`: sends copied to the host first (the copy waits for the compute that made
        them), each received tuple copied onto ``device`` when it is waited for (the host buffer
        is then free for the next receive of its shape)."""
        hosted = [(peer, tuple(t.detach().to(HOST) for t in tensors)) for peer, tensors in sends]
        onto_device = lambda message: tuple(t.to(self.device) for t in message)
        return [Received([r], None, lambda _, r=r: onto_device(r.wait()))
                for r in self.wire.post(hosted, recvs, send_keys)]

    def wait_sends(self, keys=None) -> None:
        self.wire.wait_sends(keys)

    def send_specs(self, peer: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self.wire.send_specs(peer, tensors)

    def recv_specs(self, peer: int) -> list[TensorSpec]:
        return self.wire.recv_specs(peer)


def make_p2p(device: torch.device, group=None):
    """The point-to-point transport for a rank computing on ``device``: `P2P` where the backend
    carries ``device``'s tensors (gloo on CPU, NCCL on CUDA), `HostStagedP2P` for CUDA over gloo."""
    if device.type == "cuda" and dist.is_initialized() and dist.get_backend(group) == "gloo":
        return HostStagedP2P(device, group)
    return P2P(device, group)
