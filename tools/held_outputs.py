"""Peak bytes a rank's pipeline executor holds for its stage outputs between forward and backward:
the storage of every stored output plus every send buffer still in flight (which shares an output's
storage until its send is waited for), each storage counted once. What ``free_sent_outputs``
(`mp_toolkit.engine.free_sent`) saves, measured by ``python -m tools.bench_memory --compare-free-sent``.

Sampled after every action the executor runs (each compute handler and each batch of comm
actions), so a peak between two actions is seen. Not imported by the library.
"""
from __future__ import annotations


class HeldOutputs:
    """Wraps ``executor``'s handlers; ``peak`` is the highest total seen since the last ``reset``."""

    def __init__(self, executor, p2p):
        self.executor, self.p2p, self.peak = executor, p2p, 0
        for kind, handler in list(executor.handlers.items()):
            executor.handlers[kind] = self._sampled(handler)
        executor._communicate = self._sampled(executor._communicate)

    def _sampled(self, fn):
        def run(*args):
            fn(*args)
            self.peak = max(self.peak, self.held_bytes())
        return run

    def held_bytes(self) -> int:
        storages = {}
        for _, outputs in self.executor._outputs.values():
            for t in outputs or ():
                if t.is_floating_point():
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        for _, _, buf in self.p2p._pending if self.p2p is not None else ():
            storages[buf.untyped_storage().data_ptr()] = buf.untyped_storage().nbytes()
        return sum(storages.values())

    def reset(self) -> None:
        self.peak = 0
