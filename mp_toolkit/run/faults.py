"""The test-only fault hook ``MPT_FAULTS`` (RELIABILITY.md): a rank kills or signals itself (or its
launcher) at a step or inside a save, or makes one step's values non-finite."""
from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass

from mp_toolkit.run.config import ConfigError


@dataclass(frozen=True)
class Faults:
    """Test-only fault injection, read from ``MPT_FAULTS`` (JSON; never set by the CLI)::

        {"kill": {"rank": 1, "step": 5, "in": "step"},          # SIGKILL itself at the start of step 5
         "nonfinite": [{"rank": 0, "steps": [3, 4], "kind": "grad"}],   # inf gradients on rank 0
         "flip": [{"rank": 1, "step": 3, "tensor": 1, "element": 0, "bit": 0}],  # silent corruption
         "spike": [{"rank": 0, "batch": 7}],    # global batch 7's logits x 30: a finite loss spike
         "save_error": {"rank": 1, "step": 4, "file": 2}}  # --async-save: its writer's 3rd file fails

    ``"in": "save"`` kills inside the save of that step, after this rank wrote its shards and before
    the commit. ``"signal": "SIGSTOP"`` (or SIGTERM, SIGUSR1) sends that signal instead of SIGKILL,
    ``"to": "launcher"`` sends it to the mpt launcher (the parent) instead of this rank.
    A kill happens on the first attempt only (a restart must get past it); ``kind``
    ``"loss"`` multiplies the last stage's output by inf instead (that rank must hold the last stage).
    A flip inverts one bit of one element of one tensor after that step's update (``tensor``: an index
    into `mp_toolkit.run.replicas.replica_tensors`, default 0; ``element`` and ``bit`` default 0), on
    the first attempt only, like a kill. A spike scales the last stage's output by 30 whenever a step
    reads that global batch (1-based, in the data's order; that rank must hold the last stage): a bad
    batch, which a rewind that skips it (``--spike-rewind``) no longer reads. A save error makes the
    background writer (``--async-save``) of that rank fail that write (modulo the writes it makes) of
    that step's save with ENOSPC, on the first attempt.
    """

    kill: tuple[int, int, str] | None = None
    nonfinite: tuple[tuple[int, int, str], ...] = ()
    signal: signal.Signals = signal.SIGKILL
    to_launcher: bool = False
    flips: tuple[tuple[int, int, int, int, int], ...] = ()
    spikes: tuple[tuple[int, int], ...] = ()
    save_error: tuple[int, int, int] | None = None

    @classmethod
    def parse(cls, text: str | None) -> "Faults":
        if not text:
            return cls()
        try:
            doc = json.loads(text)
            kill = doc.get("kill")
            sig = signal.Signals[kill.get("signal", "SIGKILL")] if kill else signal.SIGKILL
            to_launcher = kill.get("to", "self") == "launcher" if kill else False
            kill = (int(kill["rank"]), int(kill["step"]), str(kill.get("in", "step"))) if kill else None
            bad = [(int(f["rank"]), int(s), str(f.get("kind", "grad"))) for f in doc.get("nonfinite", [])
                   for s in f["steps"]]
            flips = tuple((int(f["rank"]), int(f["step"]), int(f.get("tensor", 0)), int(f.get("element", 0)),
                           int(f.get("bit", 0))) for f in doc.get("flip", []))
            spikes = tuple((int(f["rank"]), int(f["batch"])) for f in doc.get("spike", []))
            e = doc.get("save_error")
            save_error = (int(e["rank"]), int(e["step"]), int(e.get("file", 0))) if e else None
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(f"MPT_FAULTS {text!r} is not the documented JSON ({e})") from None
        if (kill and kill[2] not in ("step", "save")) or any(k not in ("grad", "loss") for *_, k in bad):
            raise ConfigError(f"MPT_FAULTS {text!r}: kill.in is step or save, nonfinite kind is grad or loss")
        return cls(kill, tuple(bad), sig, to_launcher, flips, spikes, save_error)

    def kill_here(self, env, step: int, where: str) -> None:
        """At ``step`` / ``where`` on the first attempt of ``env``'s rank (a `run.launch.LaunchEnv`): the signal."""
        if env.attempt == 0 and self.kill == (env.rank, step, where):
            sys.stdout.flush()
            os.kill(os.getppid() if self.to_launcher else os.getpid(), self.signal)

    def nonfinite_at(self, rank: int, step: int, batch: int = 0) -> str | None:
        """What this rank makes of step ``step``, which reads global batch ``batch``: "grad", "loss",
        "spike" or None."""
        kind = next((kind for r, s, kind in self.nonfinite if (r, s) == (rank, step)), None)
        return kind or ("spike" if (rank, batch) in self.spikes else None)

    def flips_at(self, env, step: int) -> list[tuple[int, int, int]]:
        """(tensor, element, bit) of each bit ``env``'s rank flips after ``step`` (first attempt only)."""
        return [(t, e, b) for r, s, t, e, b in self.flips if (r, s) == (env.rank, step) and env.attempt == 0]

    def save_error_at(self, env, step: int) -> int | None:
        """The write of ``step``'s background save that fails on ``env``'s rank (first attempt), or None."""
        e = self.save_error
        return e[2] if e is not None and e[:2] == (env.rank, step) and env.attempt == 0 else None
