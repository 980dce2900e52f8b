"""Schedule IR: one list of actions per rank, spelled like ``torch.distributed.pipelining``.

An action is ``f"{stage}{kind}{microbatch}"``: ``0F3`` (stage 0 forward of micro-batch 3),
``1B2`` (full backward), ``1I2`` / ``1W2`` (backward for input / for weights, zero-bubble
schedules), and the communication actions ``0SEND_F1``, ``1RECV_F1``, ``1SEND_B1``, ``0RECV_B1``.
A :class:`Schedule` can be printed, diffed and exchanged as CSV with torch's ``_dump_csv``
format (one row per rank, one action per cell).

Communication semantics (what the executor implements and the validator proves):

* Every action is written with a stage owned by the rank whose list holds it.
* ``{s}SEND_F{k}`` on the rank of stage ``s`` sends stage ``s``'s forward output of micro-batch
  ``k`` to the rank of stage ``s+1``; it is matched by ``{s+1}RECV_F{k}`` on that rank.
* ``{s}SEND_B{k}`` sends stage ``s``'s input-gradient of micro-batch ``k`` to the rank of stage
  ``s-1``; it is matched by ``{s-1}RECV_B{k}``.
* Sends are asynchronous: they are posted and never block. A receive blocks until its matching
  send has been posted.
* Messages between one pair of ranks in one direction are matched in FIFO order, so receives
  on a channel must appear in the order of the sends.
* Consecutive comm actions in a rank's list may be batched by the executor into one
  ``batch_isend_irecv`` call (this only posts sends earlier, so it cannot add a deadlock).
* Adjacent stages placed on the same rank hand activations over locally: no comm actions are
  written between them.
"""
from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import dataclass
from enum import Enum
from typing import IO, Iterable, Sequence

__all__ = ["Kind", "Action", "Schedule"]


class Kind(str, Enum):
    """What an action does; the value is its spelling inside an action string."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  backward for the input gradient only (zero-bubble)
    W = "W"  # backward for the weight gradient only (zero-bubble)
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.I, Kind.W)

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_F, Kind.RECV_B)

    def __str__(self) -> str:
        return self.value


# Longest spellings first so "SEND_F" is not read as "S" + ...
_KINDS_RE = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KINDS_RE})(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step of one stage: ``Action(1, Kind.RECV_F, 3)`` is spelled ``1RECV_F3``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse ``"1RECV_F3"``; raises ``ValueError`` naming the bad text."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"bad action {text!r}: expected '<stage><kind><microbatch>' with kind one of "
                f"{', '.join(k.value for k in Kind)}, e.g. '0F3' or '1RECV_F2'"
            )
        stage, kind, mb = match.groups()
        return cls(int(stage), Kind(kind), int(mb))

    # Helper constructors, so generators read like the schedule they write.
    @classmethod
    def forward(cls, stage: int, mb: int) -> "Action":
        return cls(stage, Kind.F, mb)

    @classmethod
    def backward(cls, stage: int, mb: int) -> "Action":
        return cls(stage, Kind.B, mb)

    @property
    def peer_stage(self) -> int | None:
        """The stage on the other end of a comm action (None for compute)."""
        return {
            Kind.SEND_F: self.stage + 1,
            Kind.RECV_F: self.stage - 1,
            Kind.SEND_B: self.stage - 1,
            Kind.RECV_B: self.stage + 1,
        }.get(self.kind)

    def matching(self) -> "Action":
        """The receive that matches a send, or the send that matches a receive."""
        pairs = {
            Kind.SEND_F: Kind.RECV_F,
            Kind.RECV_F: Kind.SEND_F,
            Kind.SEND_B: Kind.RECV_B,
            Kind.RECV_B: Kind.SEND_B,
        }
        if self.kind not in pairs:
            raise ValueError(f"{self} is a compute action; only comm actions have a match")
        return Action(self.peer_stage, pairs[self.kind], self.microbatch)


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for one global batch.

    ``stage_to_rank[i]`` is the rank running stage ``i`` (identity for GPipe and 1F1B;
    interleaved schedules put several stages on one rank). ``actions[r]`` is rank ``r``'s
    list in execution order. Lists are coerced to tuples, so a Schedule is hashable data.
    """

    name: str
    num_stages: int
    microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", tuple(int(r) for r in self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if self.num_stages < 1 or self.microbatches < 1:
            raise ValueError(
                f"schedule {self.name!r} needs num_stages >= 1 and microbatches >= 1, "
                f"got {self.num_stages} and {self.microbatches}"
            )
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for "
                f"{self.num_stages} stages"
            )
        ranks = set(self.stage_to_rank)
        if ranks != set(range(len(self.actions))):
            raise ValueError(
                f"stage_to_rank uses ranks {sorted(ranks)} but the schedule has action lists "
                f"for ranks 0..{len(self.actions) - 1}; every rank must own a stage"
            )

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def rank_actions(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages owned by ``rank``, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    # ---- CSV (torch.distributed.pipelining ``_dump_csv`` format) -------------------------
    def to_csv(self, path_or_file: str | os.PathLike | IO[str]) -> None:
        """Write one row per rank, one action string per cell (no header, like torch).

        The name, ``num_stages`` and ``stage_to_rank`` are not stored; :meth:`from_csv`
        infers them or takes them as arguments.
        """
        rows = [[str(a) for a in acts] for acts in self.actions]
        if isinstance(path_or_file, (str, os.PathLike)):
            with open(path_or_file, "w", newline="") as f:
                csv.writer(f).writerows(rows)
        else:
            csv.writer(path_or_file).writerows(rows)

    @classmethod
    def from_csv(
        cls,
        path_or_file: str | os.PathLike | IO[str],
        name: str = "csv",
        num_stages: int | None = None,
        microbatches: int | None = None,
        stage_to_rank: Sequence[int] | None = None,
    ) -> "Schedule":
        """Read a CSV written by :meth:`to_csv` or torch's ``_dump_csv``.

        Row ``r`` is rank ``r``; empty cells (torch writes them for idle steps) are skipped.
        When not given: ``num_stages`` and ``microbatches`` are one more than the largest
        stage / micro-batch seen, and ``stage_to_rank`` maps each stage to the row holding
        its actions.
        """
        if isinstance(path_or_file, (str, os.PathLike)):
            with open(path_or_file, newline="") as f:
                rows = list(csv.reader(f))
        else:
            rows = list(csv.reader(path_or_file))
        actions = [
            tuple(Action.parse(cell) for cell in row if cell.strip()) for row in rows
        ]
        every = [a for acts in actions for a in acts]
        if not every:
            raise ValueError("CSV schedule holds no actions")
        if num_stages is None:
            num_stages = max(a.stage for a in every) + 1
        if microbatches is None:
            microbatches = max(a.microbatch for a in every) + 1
        if stage_to_rank is None:
            stage_to_rank = _infer_stage_to_rank(actions, num_stages)
        return cls(name, num_stages, microbatches, tuple(stage_to_rank), tuple(actions))

    def to_csv_string(self) -> str:
        buf = io.StringIO()
        self.to_csv(buf)
        return buf.getvalue()


def _infer_stage_to_rank(actions: Iterable[Sequence[Action]], num_stages: int) -> list[int]:
    owner: dict[int, int] = {}
    for rank, acts in enumerate(actions):
        for a in acts:
            if owner.setdefault(a.stage, rank) != rank:
                raise ValueError(
                    f"stage {a.stage} has actions on ranks {owner[a.stage]} and {rank}; "
                    f"pass stage_to_rank explicitly"
                )
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        raise ValueError(f"no actions for stages {missing}; pass stage_to_rank explicitly")
    return [owner[s] for s in range(num_stages)]
