"""``--spike-rewind Z,K[,R]``: a loss spike (or a run of non-finite steps) rewinds to the latest
checkpoint and skips the global batches that follow it (PaLM's remedy, done by the run itself).

A step's loss is a spike when it is more than Z standard deviations above the mean of the last
`WINDOW` applied steps' losses (judged once `MIN_STEPS` of them are known); the loss is the global
batch's, the same number on every rank, so every rank decides alike without a message. A streak of
--max-skips non-finite steps rewinds the same way instead of stopping the run (exit 3), while rewinds
are left. A rewind:

1. waits for a checkpoint still being written (``--async-save``) and loads ``latest`` into the running
   ranks (parameters, optimizer and scaler state, lr position, data position, random generators);
2. skips the next K global batches of the data (each replica advances its sample stream by K x
   micro-batches: `mp_toolkit.data.lm.MicroBatches.skip`), so the steps after the checkpoint read
   other data, in a fixed order;
3. drops the metrics rows after the checkpoint's step, and says in one line which step spiked, where
   it went back to and which batches it skipped.

At most R rewinds (default 3, `mp_toolkit.flag_values.SPIKE_REWINDS`); after that a spike is logged and
training goes on, and a non-finite streak stops the run as without the flag. The window of losses
and the rewinds taken are kept in each checkpoint's manifest (``spikes``), so a resumed run judges
the same steps alike; the data skipped after a rewind is in the data position of the next checkpoint.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 50
"""Applied steps whose losses the mean and standard deviation are taken over."""
MIN_STEPS = 10
"""Applied steps needed before a loss is judged."""


@dataclass
class SpikeGuard:
    """The loss window and the rewinds of one run (every rank keeps the same one)."""

    z: float
    skip: int
    limit: int
    losses: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    """(step, loss) of the latest applied steps."""
    rewinds: int = 0

    @classmethod
    def of(cls, setting: tuple[float, int, int] | None, saved: dict | None = None) -> SpikeGuard | None:
        """The guard of ``--spike-rewind`` (None: off), with a checkpoint's ``spikes`` state when resuming."""
        if setting is None:
            return None
        guard = cls(*setting)
        if isinstance(saved, dict):
            losses = saved.get("losses", [])
            if isinstance(losses, list):
                guard.losses.extend((int(s), float(v)) for s, v in losses[-WINDOW:]
                                    if isinstance(s, int) and isinstance(v, (int, float)) and math.isfinite(v))
            rewinds = saved.get("rewinds", 0)
            guard.rewinds = rewinds if isinstance(rewinds, int) and rewinds >= 0 else 0
        return guard

    def state(self) -> dict:
        """What a checkpoint keeps (the manifest's ``spikes``)."""
        return {"losses": [list(x) for x in self.losses], "rewinds": self.rewinds}

    def judge(self, step: int, loss: float, skipped: bool) -> str | None:
        """Why step ``step`` is a spike (None when it is not); an applied step's finite loss joins the window."""
        if skipped or not math.isfinite(loss):
            return None
        why = None
        if len(self.losses) >= MIN_STEPS:
            values = [v for _, v in self.losses]
            mean, sd = statistics.fmean(values), statistics.pstdev(values)
            if loss > mean + self.z * max(sd, 1e-12):
                why = (f"loss {loss:.4f} is {(loss - mean) / max(sd, 1e-12):.1f} standard deviations above the last "
                       f"{len(values)} steps' mean {mean:.4f} (sd {sd:.4f}, --spike-rewind {self.z:g})")
        if why is None:
            self.losses.append((step, loss))
        return why

    def accept(self, step: int, loss: float) -> None:
        """A spike that was not rewound (no rewind left, no checkpoint yet) joins the window."""
        self.losses.append((step, loss))

    @property
    def left(self) -> int:
        return self.limit - self.rewinds

    def rewound(self, to_step: int) -> None:
        """After a rewind to ``to_step``: the window as it was then, one rewind fewer left."""
        kept = [x for x in self.losses if x[0] <= to_step]
        self.losses.clear()
        self.losses.extend(kept)
        self.rewinds += 1
