"""The errors a user sees as one line (exit 2), defined where every layer may import them.

Each is raised by the layer that finds the fault (`mp_toolkit.partition` a cut that cannot be made,
`mp_toolkit.schedule` a schedule that cannot run, ...); `mpt` (`mp_toolkit.cli`) prints any of them
as ``mpt COMMAND: error: LINE``. This module imports nothing, so the command line can name them
without importing torch.
"""

from __future__ import annotations

__all__ = ["USER_ERRORS", "CheckpointError", "ConfigError", "CostModelError", "DataError", "PartitionError",
           "PeerFailed", "ScheduleError"]


class ConfigError(ValueError):
    """A value that cannot work, with the reason and what would (shown as one line, exit 2)."""


class PartitionError(ValueError):
    """A cut into stages that cannot be made (`mp_toolkit.partition`)."""


class CostModelError(ValueError):
    """A model or request the cost model cannot describe (`mp_toolkit.partition.cost`)."""


class ScheduleError(ValueError):
    """A schedule that breaks a dependency or deadlocks (`mp_toolkit.schedule.validate`)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the one-line message names the file and fault."""


class DataError(ValueError):
    """A corpus, prepared data directory or data argument the user can fix (`mp_toolkit.data`); the
    message is one line naming the file or value and what is wrong."""


class PeerFailed(Exception):
    """Another rank failed and reports the error itself; this rank only exits (code 2)."""


USER_ERRORS = (ConfigError, PartitionError, CostModelError, ScheduleError, CheckpointError, DataError)
"""What `mpt` prints as one line (the first line of the message) and exits 2 on."""
