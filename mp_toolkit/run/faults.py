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
         "nonfinite": [{"rank": 0, "steps": [3, 4], "kind": "grad"}]}   # inf gradients on rank 0

    ``"in": "save"`` kills inside the save of that step, after this rank wrote its shards and before
    the commit. ``"signal": "SIGSTOP"`` (or SIGTERM, SIGUSR1) sends that signal instead of SIGKILL,
    ``"to": "launcher"`` sends it to the mpt launcher (the parent) instead of this rank.
    A kill happens on the first attempt only (a restart must get past it); ``kind``
    ``"loss"`` multiplies the last stage's output by inf instead (that rank must hold the last stage).
    """

    kill: tuple[int, int, str] | None = None
    nonfinite: tuple[tuple[int, int, str], ...] = ()
    signal: signal.Signals = signal.SIGKILL
    to_launcher: bool = False

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
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(f"MPT_FAULTS {text!r} is not the documented JSON ({e})") from None
        if (kill and kill[2] not in ("step", "save")) or any(k not in ("grad", "loss") for *_, k in bad):
            raise ConfigError(f"MPT_FAULTS {text!r}: kill.in is step or save, nonfinite kind is grad or loss")
        return cls(kill, tuple(bad), sig, to_launcher)

    def kill_here(self, env, step: int, where: str) -> None:
        """At ``step`` / ``where`` on the first attempt of ``env``'s rank (a `run.launch.LaunchEnv`): the signal."""
        if env.attempt == 0 and self.kill == (env.rank, step, where):
            sys.stdout.flush()
            os.kill(os.getppid() if self.to_launcher else os.getpid(), self.signal)

    def nonfinite_at(self, rank: int, step: int) -> str | None:
        return next((kind for r, s, kind in self.nonfinite if (r, s) == (rank, step)), None)
