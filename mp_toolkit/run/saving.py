"""A running job's checkpoints: each one checked (``--check-replicas``), written synchronously or in the
background (``--async-save``), waited for, and gone back to (``--spike-rewind``).

`run.loop` owns one `RunCheckpoints` per rank; every rank calls each method after the same step.
"""

from __future__ import annotations

from mp_toolkit.engine.interface import TrainEngine
from mp_toolkit.parallel.context import ParallelContext
from mp_toolkit.run.async_save import AsyncSaver
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.run.launch import LaunchEnv, RankStatus
from mp_toolkit.run.metrics import MetricsLog
from mp_toolkit.run.replicas import ReplicaCheck
from mp_toolkit.run.skips import SaveSchedule, SkipStreak
from mp_toolkit.run.spikes import SpikeGuard
from mp_toolkit.run.state import ModelNames, Progress, load_state, manifest, save_state


class RunCheckpoints:
    """This rank's side of the run's checkpoints (``data`` and ``spec`` as the loop holds them)."""

    def __init__(self, cfg: TrainConfig, env: LaunchEnv, ctx: ParallelContext, engine: TrainEngine,
                 names: ModelNames, data, spec, status: RankStatus, log: MetricsLog, run_id: str):
        self.cfg, self.env, self.ctx, self.engine, self.names = cfg, env, ctx, engine, names
        self.data, self.spec, self.status, self.log, self.run_id = data, spec, status, log, run_id
        self.check = ReplicaCheck(cfg.faults.check_replicas)
        self.saver = AsyncSaver(ctx, cfg.faults.timeout_s, log) if cfg.checkpoint.async_save else None

    def check_replicas(self, step: int) -> None:
        self.status.set(f"while checking replicas after step {step}")
        self.check(self.engine, self.ctx, step)

    def save(self, step: int, row: dict, progress: Progress, spikes: SpikeGuard | None) -> None:
        """Save ``step`` (its metrics ``row`` gives the lr), replicas checked first when --check-replicas."""
        cfg, env = self.cfg, self.env
        if self.check.every and not self.check.due(step):  # a checkpoint holds only checked values
            self.check_replicas(step)
        self.status.set(f"while saving step {step}")
        meta = (manifest(cfg, self.engine, self.ctx, self.data, progress, self.spec, row["lr"], self.run_id,
                         spikes.state() if spikes is not None else None) if env.rank == 0 else None)
        root, keep = cfg.checkpoint.save_dir, cfg.checkpoint.keep
        hook = lambda: env.faults.kill_here(env, step, "save")  # noqa: E731 -- the test hook, once its shards are out
        if self.saver is None:
            save_state(root, meta, self.engine, self.ctx, self.names, step, keep, after_shards=hook)
            self.log.note(f"saved step {step} to {root}")
        else:
            self.saver.save(root, meta, self.engine, self.names, step, keep, after_shards=hook,
                            fail_at=env.faults.save_error_at(env, step))
            self.log.note(f"saving step {step} to {root} in the background")

    def prepare(self) -> None:
        """After the first step of a start: --async-save makes its copy's buffers in the background."""
        if self.saver is not None:
            self.saver.prepare(self.engine, self.names)

    def finish(self) -> None:
        """The background save in flight (--async-save) is committed, on every rank."""
        if self.saver is not None:
            self.status.set(f"while saving step {self.saver.step}")
            self.saver.finish()

    def rewind(self, step: int, why: str, progress: Progress, spikes: SpikeGuard, streak: SkipStreak,
               saves: SaveSchedule) -> int:
        """Back to ``latest`` and past the next K global batches (`run.spikes`); the step to train next."""
        self.finish()
        self.status.set(f"while rewinding after step {step}")
        cfg, data = self.cfg, self.data
        back = load_state(cfg.checkpoint.save_dir, cfg, self.engine, self.ctx, self.names, data, self.spec).progress
        progress.step, progress.applied = back.step, back.applied
        m = cfg.batch.microbatches
        first_skipped = data.position // m + 1
        data.skip(spikes.skip * m)
        spikes.rewound(back.step)
        streak.count, saves.deferred = 0, False
        self.log.rewind(back.step)
        self.log.note(f"step {step}: {why}: rewound to step-{back.step:08d}, skipping global batches {first_skipped}-"
                      f"{first_skipped + spikes.skip - 1} (rewind {spikes.rewinds} of {spikes.limit})")
        return back.step + 1
