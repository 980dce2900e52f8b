"""Pipeline schedules as data: action IR, generators, validator, text views, simulator, Gantt.

>>> from mp_toolkit.schedule import get_schedule, validate, format_schedule
>>> s = get_schedule("1F1B", num_stages=2, microbatches=3)
>>> validate(s)
>>> print(format_schedule(s))
time    0  1  2  3  4  5  6  7
rank 0 F0 F1  . B0 F2 B1  . B2
rank 1  . F0 B0 F1 B1 F2 B2  .
"""
from .actions import Action, Kind, Schedule
from .gantt import draw_gantt
from .generators import GENERATORS, get_schedule, gpipe, one_f_one_b, placement
from .interleaved import insert_comms, interleaved_1f1b
from .printer import format_actions, format_schedule, makespan, unit_time_steps
from .report import simulate_report
from .simulator import DEFAULT_COSTS, Event, Timeline, cost_function, simulate
from .validate import ScheduleError, simulate_order, validate
from .vshape import dualpipev, v_placement, zbv
from .zero_bubble import SPLIT_SCHEDULES, split_share, zb_drain, zbh1

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "GENERATORS",
    "get_schedule",
    "placement",
    "v_placement",
    "zbv",
    "dualpipev",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zbh1",
    "zb_drain",
    "split_share",
    "SPLIT_SCHEDULES",
    "insert_comms",
    "ScheduleError",
    "validate",
    "simulate_order",
    "format_schedule",
    "format_actions",
    "makespan",
    "unit_time_steps",
    "simulate",
    "simulate_report",
    "cost_function",
    "DEFAULT_COSTS",
    "Timeline",
    "Event",
    "draw_gantt",
]
