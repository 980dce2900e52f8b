"""Certify the planner on this machine (issue 36, item 4): predict about a hundred layouts of
gpt-tiny, gpt-small-cpu and bert-tiny with this machine's measured profile, train each with
``mpt train`` on the very cut the planner chose, and report how far the predictions are.

    python -m tools.certify_plan                        # ~100 layouts x 2 rounds: about an hour on 2 cores
    python -m tools.certify_plan --quick                # 4 layouts of the tiny models at 1-2 ranks, 1 round
                                                        # of 3 steps (one timed step: no within-run spread),
                                                        # timed in the memory run (--one-run): a smoke
    python -m tools.certify_plan --layouts 12 --rounds 2 --profile here.json --json cert.json

1. **Profiles**: for each model its own, measured by `profile_here.measure_profile` at the model's
   shapes (a small model's products and layer calls run at other rates than a larger one's) over
   ``--max-world`` gloo ranks (``devices_per_node`` = that count, so every world of the run sits in
   one node) and calibrated in its runs' pattern (`mp_toolkit.partition.calibrate`: five short runs,
   pp 2 at 2, 4 and 6 micro-batches, tp 2 at 2 and a memory run of one rank at 2, all 1F1B without
   recomputation: layouts of the space certified here, about ten seconds each); or ``--profile
   FILE`` for every model, ``--profile MODEL=FILE`` for each (``--save-profile FILE`` keeps the
   measured ones, FILE's stem-MODEL.suffix each). They are printed first.
2. **Layouts**: every (pp in 1,2,4) x (tp in 1,2) x (dp in 1,2) with pp x tp x dp <= ``--max-world``,
   micro-batch counts 2,4,8, every schedule (interleaved with 2 chunks; pp 1: one), recomputation
   none / selective / full, ZeRO 0 / 1 (1 with dp 2), of each model at its fixed micro-batch and
   sequence length (`MODELS`). The planner (`make_plan` raising) and ``mpt train``'s own checks
   (`resolve_run`, what ``--dry-run`` runs) refuse some: counted per reason, never run. ``--layouts
   N`` of the rest are chosen, deterministically for a ``--seed`` (`select`): the schedule sweep
   (every schedule of each model at pp 2, 4 micro-batches), then one layout for every value of
   every dimension not yet covered, then a seeded round-robin over model x grid (pp, tp, dp) that
   prefers layouts whose group (model x world size x global batch) is already chosen, so that
   groups have several members to rank.
3. **Runs**: each layout is trained by ``mpt train`` with ``--partition`` the plan's boundaries,
   its schedule, chunks, recomputation, ZeRO stage, tp, dp, synthetic data, fp32, AdamW, and the
   threads ``mpt train`` picks (this machine's cores over the ranks: the profile's ``rank_tflops``
   assumes the same share). ``--rounds R`` rounds over all layouts, forward then reverse, so slow
   drift of the machine does not favour one end of the list. The step time of a round is the
   median of the steps after the first two (rank 0's ``step_time_s``); a layout's, the median of
   its rounds. In the first round a second, short run per layout (`MEMORY_STEPS`, glibc mapping
   every block above 64 KiB on its own, ``MALLOC_MMAP_THRESHOLD_``, so resident memory follows
   the live tensors; it slows kernels, hence a separate run) gives each rank's peak memory.

**What is compared.** Time: the plan's ``step_time_ms`` against the measured step time. Memory,
per rank: the plan's **tensor bytes** of that pipeline rank (the sum of its stages'
``memory_bytes``, which is ``Plan.rank_bytes`` less the profile's ``runtime_gb`` on a ``cpu``
profile, whose allocator factor is 1, and with the profile's ``heap_gb`` and ``comm_gb``) against the
run's ``peak_memory_bytes`` (the rank's peak resident memory less file pages -- the library code its
kernels page in -- over the steps after the first, above its baseline taken after imports and
torch's warm-up, before the model is built). Both leave out what the process holds before the
model; the profile's ``runtime_gb`` (a fresh interpreter with torch and a process group) is not
certified by this comparison. A layout's peak is its largest rank's. The memory cap is on a rank's
device bytes: predicted ``max(Plan.rank_bytes)`` (tensor bytes + runtime, what ``Plan.fits``
compares), measured the largest measured peak + the same runtime; the default cap is the geometric
mean of the smallest and largest measured device peaks, ``--cap-gb`` sets it. The JSON line also
carries ``baseline_bound_bytes``: per rank, peak RSS since the process started less the steps'
peak above the baseline, an upper bound of the run's real baseline, to set beside ``runtime_gb``.

**Oversubscribed worlds.** A ``cpu`` profile gives the rate of one core, the node's core count and
how much a rank gains from more threads (``thread_speedup``): 1 rank on 2 cores runs with 2 threads
at that speed-up. Where ranks outnumber cores (4 ranks on 2), each is planned at a whole core while
it computes and the plan stretches every compute action by the cores' mean demand (the ranks over
the cores times the share of the step they compute: `planner.contended`), since a rank waiting in a
receive or the bubble leaves its core to the others; the step's closing collectives stretch by the
ranks over the cores. (`partition/contention.py`, helpers beside layers being timed, applies to
measured layer times only.)

The figures (`tools.certify_stats`): step-time and peak-memory MAPE, Kendall's tau-b within
groups and pooled, top-1 regret per group, false "fits" under the cap, run-to-run noise, and the
errors broken down by every dimension. Prints the machine header first, the tables, then one JSON
line (`tools.report.json_line`). Nothing else should run on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from mp_toolkit.parallel.context import grid_coords
from mp_toolkit.partition.calibrate import MEMORY_ENV, MEMORY_STEPS
from mp_toolkit.partition.cluster import ClusterError, ClusterProfile, profile_to_dict, read_profile
from mp_toolkit.partition.planner import Plan, make_plan
from mp_toolkit.partition.profile_here import measure_profile, write_profile
from mp_toolkit.partition.request import PlanRequest
from tools.certify_stats import DIMENSIONS, summarize
from tools.certify_tables import print_tables
from tools.predict import resolve_run, train_config
from tools.ranks import RunError, mpt
from tools.report import header, json_line

MODELS = {"gpt-tiny": (8, 64), "gpt-small-cpu": (4, 64), "bert-tiny": (8, 64)}
"""Each model's (micro-batch, sequence length): a step of 0.1-0.5 s on 2 cores."""
PIPELINE_SCHEDULES = (("1f1b", 1), ("zbh1", 1), ("interleaved", 2), ("gpipe", 1), ("zbdrain", 1))
"""At pp > 1, with their chunks; the order of the schedule sweep (`select`)."""
MICROBATCHES = (2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
QUICK = {"layouts": 4, "rounds": 1, "steps": 3, "models": "gpt-tiny,bert-tiny", "max_world": 2, "one_run": True}
DEFAULTS = {"layouts": 100, "rounds": 2, "steps": 8, "models": ",".join(MODELS), "max_world": 4, "one_run": False}


@dataclass(frozen=True)
class Layout:
    """One point of the search space."""

    model: str
    pp: int
    tp: int
    dp: int
    microbatches: int
    schedule: str
    chunks: int
    recompute: str
    zero: int

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatches * MODELS[self.model][0]

    @property
    def group(self) -> str:
        """Layouts doing the same work on the same ranks: their step times compare."""
        return f"{self.model} w{self.world} b{self.global_batch}"

    @property
    def label(self) -> str:
        sched = self.schedule + (f"x{self.chunks}" if self.chunks > 1 else "")
        return (f"{self.model} pp{self.pp} tp{self.tp} dp{self.dp} m{self.microbatches} {sched} "
                f"rc:{self.recompute} z{self.zero}")

    def request(self, profile: ClusterProfile) -> PlanRequest:
        mb, seq = MODELS[self.model]
        return PlanRequest(self.model, pp=self.pp, tp=self.tp, dp=self.dp, micro_batch=mb,
                           microbatches=self.microbatches, seq_len=seq, method="flops", schedule=self.schedule,
                           chunks=self.chunks, recompute=self.recompute, zero=self.zero, cluster=profile,
                           precision="fp32", optimizer="adamw", load=False)

    def train_settings(self, boundaries: list[int]) -> dict:
        """``mpt train``'s flags for this layout on ``boundaries``, by their flat names."""
        mb, seq = MODELS[self.model]
        return dict(pp=self.pp, tp=self.tp, dp=self.dp, zero=self.zero, schedule=self.schedule, chunks=self.chunks,
                    partition=",".join(map(str, boundaries)), micro_batch=mb, microbatches=self.microbatches,
                    seq_len=seq, recompute=self.recompute, optimizer="adamw", precision="fp32", data="synthetic")


def space(models: list[str], max_world: int) -> list[Layout]:
    """Every layout of the issue's space (module docstring, 2.) up to ``max_world`` ranks."""
    out = []
    for model in models:
        for pp in (1, 2, 4):
            for tp in (1, 2):
                for dp in (1, 2):
                    if pp * tp * dp > max_world:
                        continue
                    for m in MICROBATCHES:
                        for schedule, chunks in (PIPELINE_SCHEDULES if pp > 1 else (("1f1b", 1),)):
                            for rec in RECOMPUTE:
                                for zero in ((0, 1) if dp == 2 else (0,)):
                                    out.append(Layout(model, pp, tp, dp, m, schedule, chunks, rec, zero))
    return out


class Checker:
    """Plans a layout once, and keeps what refused it: the planner or ``mpt train``'s checks."""

    def __init__(self, profiles: dict[str, ClusterProfile]):
        self.profiles = profiles
        self.plans: dict[Layout, Plan | None] = {}
        self.refused: Counter[str] = Counter()

    def plan(self, layout: Layout) -> Plan | None:
        if layout not in self.plans:
            self.plans[layout] = self._plan(layout)
        return self.plans[layout]

    def _plan(self, layout: Layout) -> Plan | None:
        try:
            plan = make_plan(layout.request(self.profiles[layout.model]))
        except ValueError as e:  # PartitionError, CostModelError: the planner's one-line refusals
            self.refused[f"planner: {e}"] += 1
            return None
        try:
            run = resolve_run(train_config(layout.model, **layout.train_settings(plan.boundaries)))
        except ValueError as e:  # ConfigError: what mpt train --dry-run would refuse
            self.refused[f"mpt train: {e}"] += 1
            return None
        if list(run.boundaries) != list(plan.boundaries):
            self.refused["mpt train cuts elsewhere"] += 1
            return None
        return plan


def select(candidates: list[Layout], n: int, seed: int, usable) -> list[Layout]:
    """``n`` usable layouts (``usable(layout)``: planned and accepted), deterministic for ``seed``:
    the schedule sweep, then coverage of every value of every dimension, then a round-robin over
    model x grid (pp, tp, dp) preferring layouts of groups already chosen (module docstring, 2.)."""
    order = list(candidates)
    random.Random(seed).shuffle(order)
    chosen: list[Layout] = []

    def take(pool) -> bool:
        for lay in pool:
            if len(chosen) < n and lay not in chosen and usable(lay):
                chosen.append(lay)
                return True
        return False

    known = set(candidates)
    models = list(dict.fromkeys(c.model for c in candidates))
    for schedule, chunks in PIPELINE_SCHEDULES:  # the sweep
        for model in models:
            take(lay for lay in [Layout(model, 2, 1, 1, 4, schedule, chunks, "none", 0)] if lay in known)
    for dim in DIMENSIONS:  # coverage
        for value in sorted({getattr(c, dim) for c in candidates}):
            if not any(getattr(c, dim) == value for c in chosen):
                take(c for c in order if getattr(c, dim) == value)
    strata: dict[tuple, list[Layout]] = {}
    for c in order:
        strata.setdefault((c.model, c.pp, c.tp, c.dp), []).append(c)
    while len(chosen) < n:
        grew = False
        for pool in strata.values():
            groups = {c.group for c in chosen}
            grew |= take([c for c in pool if c.group in groups]) or take(pool)
        if not grew:
            break
    return chosen


def train(layout: Layout, plan: Plan, steps: int, folder: Path, timeout_s: float, memory: bool) -> list[dict]:
    """The metrics rows of one ``mpt train`` run of ``layout`` on ``plan``'s cut (``memory``: the memory run)."""
    path = folder / "metrics.jsonl"
    path.unlink(missing_ok=True)
    flags = []
    for name, value in layout.train_settings(plan.boundaries).items():
        if name == "chunks" and value == 1:
            continue  # --chunks is the interleaved schedule's
        flags += [f"--{name.replace('_', '-')}", str(value)]
    # BERT's synthetic corpus is prepared on first use: into the tool's folder, never the user's cache
    mpt("train", "--model", layout.model, *flags, "--steps", str(steps), "--metrics", str(path), "--no-progress",
        "--cache-dir", str(folder / "cache"), env=MEMORY_ENV if memory else None, timeout_s=timeout_s)
    return [json.loads(line) for line in path.read_text().splitlines()]


def record(layout: Layout, plan: Plan) -> dict:
    """The layout's row before it is measured: the prediction, per global rank."""
    to_rank = plan.timeline.schedule.stage_to_rank
    tensor = [0] * layout.pp
    for st in plan.stages:
        tensor[to_rank[st.index]] += st.memory_bytes
    ranks = [tensor[grid_coords(g, layout.pp, layout.tp, layout.dp)[0]] for g in range(layout.world)]
    return {"label": layout.label, **asdict(layout), "world": layout.world, "group": layout.group,
            "micro_batch": MODELS[layout.model][0], "seq_len": MODELS[layout.model][1],
            "boundaries": list(plan.boundaries), "pred_step_ms": plan.step_time_ms, "round_step_ms": [],
            "step_spreads": [], "pred_rank_bytes": ranks, "pred_peak_bytes": max(ranks),
            "pred_device_bytes": max(plan.rank_bytes)}


def measure(row: dict, layout: Layout, plan: Plan, steps: int, folder: Path, timeout_s: float, first: bool,
            one_run: bool = False) -> None:
    """One round of ``layout``: its step time into ``row``; in the first round its memory run too
    (``one_run``: both from the memory run, `QUICK`'s smoke)."""
    metrics = train(layout, plan, steps, folder, timeout_s, memory=one_run)
    times = [r["step_time_s"] * 1e3 for r in metrics[2:]]
    med = statistics.median(times)
    row["round_step_ms"].append(med)
    # one timed step (--steps 3) has no spread
    row["step_spreads"].append(statistics.median(abs(t - med) for t in times) / med if len(times) > 1 else None)
    if first:
        last = metrics[-1] if one_run else train(layout, plan, MEMORY_STEPS, folder, timeout_s, memory=True)[-1]
        row["meas_rank_bytes"] = last["peak_memory_bytes"]
        row["meas_peak_bytes"] = max(last["peak_memory_bytes"])
        row["train_planned_bytes"] = last["planned_memory_bytes"]
        row["baseline_bound_bytes"] = [a - b for a, b in zip(last["peak_rss_bytes"], last["peak_memory_bytes"])]


def certify(layouts: list[Layout], checker: Checker, rounds: int, steps: int, timeout_s: float,
            one_run: bool = False):
    """(the measured rows, {label: why it failed}) over ``rounds`` alternating rounds."""
    rows = {lay: record(lay, checker.plan(lay)) for lay in layouts}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="certify_plan_") as d:
        for rnd in range(rounds):
            order = layouts if rnd % 2 == 0 else layouts[::-1]
            for i, lay in enumerate(order, 1):
                if lay.label in failed:
                    continue
                row = rows[lay]
                try:
                    measure(row, lay, checker.plan(lay), steps, Path(d), timeout_s, first=rnd == 0, one_run=one_run)
                except (RunError, KeyError, ValueError) as e:
                    failed[lay.label] = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                    print(f"[{rnd + 1}.{i}/{len(order)}] {lay.label}: FAILED {failed[lay.label]}", flush=True)
                    continue
                print(f"[{rnd + 1}.{i}/{len(order)}] {lay.label}: {row['round_step_ms'][-1]:.1f} ms "
                      f"(predicted {row['pred_step_ms']:.1f}), peak {row['meas_peak_bytes'] / 1e6:.1f} MB "
                      f"(predicted {row['pred_peak_bytes'] / 1e6:.1f})", flush=True)
    done = [r for lay, r in rows.items() if lay.label not in failed]
    for r in done:
        r["meas_step_ms"] = statistics.median(r["round_step_ms"])
        spreads = [x for x in r["step_spreads"] if x is not None]
        r["step_spread"] = statistics.median(spreads) if spreads else None
    return done, failed


def profile_files(given: list[str], models: list[str]) -> dict[str, str]:
    """``--profile`` values: one ``FILE`` for every model, or ``MODEL=FILE`` for each."""
    if len(given) == 1 and "=" not in given[0]:
        return {m: given[0] for m in models}
    files = dict(g.split("=", 1) for g in given if "=" in g)
    missing = [m for m in models if m not in files]
    if len(files) != len(given) or missing:
        raise ClusterError(f"--profile: give one FILE, or MODEL=FILE for each of {', '.join(models)}"
                           + (f" ({missing[0]} has none)" if missing else ""))
    return files


def saved_path(path: str, model: str, per_model: bool) -> Path:
    """Where ``--save-profile PATH`` writes ``model``'s profile: PATH, or with the model's name before
    its suffix when each model has its own."""
    p = Path(path)
    return p.with_name(f"{p.stem}-{model}{p.suffix}") if per_model else p


def get_profiles(args, max_world: int) -> dict[str, ClusterProfile]:
    """Per model, the profile it is planned with: ``--profile``'s, or each model's own measured here
    at its shapes and calibrated in its runs' pattern (`mp_toolkit.partition.calibrate`)."""
    if args.profile:
        files = profile_files(args.profile, args.models)
        profiles = {m: read_profile(f) for m, f in files.items()}
    else:
        profiles = {}
        for m in args.models:
            mb, seq = MODELS[m]
            profiles[m] = measure_profile(m, ranks=max(2, max_world), precisions=("fp32",), micro_batch=mb,
                                          seq_len=seq, calibrated=True)
    for m, profile in profiles.items():
        if profile.devices_per_node < max_world:
            raise ClusterError(f"--profile for {m}: {profile.devices_per_node} devices per node, fewer than the "
                               f"{max_world} ranks of the largest world: measure one here (leave out --profile)")
    if args.save_profile:
        per_model = len({repr(profile_to_dict(p)) for p in profiles.values()}) > 1
        for m, profile in profiles.items():
            write_profile(profile, saved_path(args.save_profile, m, per_model))
    return profiles


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", type=int, help=f"how many layouts (default {DEFAULTS['layouts']})")
    ap.add_argument("--rounds", type=int,
                    help=f"rounds over all layouts, alternating order (default {DEFAULTS['rounds']})")
    ap.add_argument("--steps", type=int, help=f"steps per timing run, at least 3 (default {DEFAULTS['steps']})")
    ap.add_argument("--models", help=f"comma-separated, among {', '.join(MODELS)} (default all)")
    ap.add_argument("--max-world", type=int, choices=(1, 2, 4), help="largest pp x tp x dp (default 4)")
    ap.add_argument("--quick", action="store_true", help="defaults " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in QUICK.items()))
    ap.add_argument("--seed", type=int, default=0, help="the layout sample's seed")
    ap.add_argument("--one-run", action="store_const", const=True, default=None,
                    help="time each layout in its memory run (one run per layout and round: a smoke; glibc's "
                         "memory setting slows the kernels)")
    ap.add_argument("--profile", action="append", default=[], metavar="FILE|MODEL=FILE",
                    help="a profile file for every model, or MODEL=FILE for each (repeat): instead of measuring")
    ap.add_argument("--save-profile", metavar="FILE",
                    help="write the profiles used here (FILE; FILE's stem-MODEL.suffix when each model has its own)")
    ap.add_argument("--cap-gb", type=float, help="the memory cap per rank (default: between the measured peaks)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mpt train run")
    ap.add_argument("--json", type=Path, help="also write the JSON line here")
    args = ap.parse_args()
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        ap.error(f"--models {unknown[0]}: not one of {', '.join(MODELS)}")
    if args.steps < 3 or args.rounds < 1 or args.layouts < 1:
        ap.error(f"--steps {args.steps} (at least 3), --rounds {args.rounds}, --layouts {args.layouts} (at least 1)")
    if args.cap_gb is not None and not args.cap_gb > 0:
        ap.error(f"--cap-gb {args.cap_gb}: a positive number of GB")
    return args


def main() -> None:
    args = parse()
    head = header("certify_plan")
    try:
        profiles = get_profiles(args, args.max_world)
    except ClusterError as e:  # a profile that cannot be read, measured, used or written: one line
        print(f"certify_plan: {e}", file=sys.stderr)
        sys.exit(2)
    for m, profile in profiles.items():
        print(f"{m}: {profile.describe()}", flush=True)
    checker = Checker(profiles)
    candidates = space(args.models, args.max_world)
    layouts = select(candidates, args.layouts, args.seed, lambda lay: checker.plan(lay) is not None)
    print(f"{len(layouts)} of {len(candidates)} layouts ({sum(checker.refused.values())} refused of "
          f"{len(checker.plans)} checked); {args.rounds} round(s) of {args.steps} steps, "
          + ("timed in the memory run" if args.one_run else f"a memory run of {MEMORY_STEPS} in the first"), flush=True)
    rows, failed = certify(layouts, checker, args.rounds, args.steps, args.timeout, args.one_run)
    if not rows:
        raise SystemExit("no layout was measured: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    runtime = max(int(p.device.runtime_gb * 1e9) for p in profiles.values())
    summary = summarize(rows, runtime, None if args.cap_gb is None else int(args.cap_gb * 1e9))
    print_tables(rows, summary, checker.refused, failed, runtime)
    settings = {k: getattr(args, k) for k in ("layouts", "rounds", "steps", "models", "max_world", "seed", "cap_gb",
                                              "one_run")}
    json_line("certify_plan", head, args.json, profile=profile_to_dict(profiles[args.models[0]]),
              profiles={m: profile_to_dict(p) for m, p in profiles.items()}, settings=settings,
              models={m: {"micro_batch": mb, "seq_len": seq} for m, (mb, seq) in MODELS.items()},
              space=len(candidates), refused=dict(checker.refused), failed=failed, summary=summary, rows=rows)


if __name__ == "__main__":
    main()
