"""The names `mpt`'s choice flags take, each list written once: the parser (`mp_toolkit.cli_args`),
`TrainConfig`, the planner, the DeepSpeed config reader and the library import them from here.

Imports nothing, so ``mpt --help`` builds its parser without torch.
"""

from __future__ import annotations

SCHEDULE_TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zbdrain": "ZBDrain",
                   "zbh1": "ZBH1", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
"""Each pipeline schedule (`mp_toolkit.schedule`) by its name here and its torch.distributed.pipelining
name. Simplest first: ``--schedule auto`` gives a tie to the earlier (`partition.auto_schedule`)."""
SCHEDULES = tuple(SCHEDULE_TITLES)
"""The schedule names ``--schedule``, `TrainConfig.schedule` and `PlanRequest.schedule` take."""
_SPELLINGS = {**{title.lower(): name for name, title in SCHEDULE_TITLES.items()},
              **{name: name for name in SCHEDULES}, "zb-h1": "zbh1", "zb-drain": "zbdrain", "zb-v": "zbv"}
V_SCHEDULES = ("zbv", "dualpipev")
"""The schedules that place two stages on each rank in a V (rank r: stages r and 2 pp - 1 - r,
`mp_toolkit.schedule.vshape`)."""


def stages_per_rank(schedule: str, chunks: int | None = None) -> int:
    """How many stages each rank holds under ``schedule`` (a name in `SCHEDULES`): ``chunks`` (default 2)
    for the interleaved schedule, 2 for the V schedules, 1 for the others. The cut has pp x this many
    stages; ``--chunks`` spells it, and only interleaved takes another value than its default."""
    if schedule == "interleaved":
        return 2 if chunks is None else chunks
    return 2 if schedule in V_SCHEDULES else 1

PRECISIONS = ("fp32", "fp16", "bf16")
"""What stages compute and communicate in (`optim.master.PRECISIONS` gives each its dtype);
``mpt train --precision`` also takes ``auto``."""
OPTIMIZERS = ("adamw", "adam", "adagrad", "rmsprop", "sgd", "lamb", "lars")
"""What `optim.factory.build_optimizer` builds."""
LR_DECAYS = ("none", "linear", "cosine")
"""Learning-rate decay after the warm-up (`optim.lr`)."""
LAMB_RULES = ("mp_toolkit", "deepspeed")
"""``--lamb-rule`` (`optim.lamb`): mp_toolkit (biases and norm weights neither decayed nor adapted, corrected
moments) or deepspeed (DeepSpeed FusedLamb's: every tensor adapted and clamped, the correction in the step size)."""
RECOMPUTE_MODES = ("none", "full", "selective")
"""Activation recomputation of a stage's block layers (`mp_toolkit.recompute`)."""
PLAN_METHODS = ("uniform", "parameters", "flops", "time", "type:REGEX", "memory")
"""How ``mpt plan`` cuts (`partition.planner`)."""


def schedule_name(text: str) -> str | None:
    """The name in `SCHEDULES` that ``text`` spells (any case; torch's name such as ``Interleaved1F1B``,
    or ``zb-h1`` / ``zb-drain``), or None."""
    return _SPELLINGS.get(text.lower())
