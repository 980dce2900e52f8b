"""A DeepSpeed config's ``wandb`` section: rank 0 logs every metrics row to an offline W&B run
(`mp_toolkit.run.loggers.WandbLog`), read back here from the run's own ``.wandb`` file; without the
package the key is refused in one line.

The ``.wandb`` file is W&B's transaction log: a 7-byte header (``:W&B``, a magic number, a version),
then LevelDB's log format (32 KiB blocks of records, each a 7-byte header -- CRC, length, type --
and a chunk; a block's last < 7 bytes are padding), each whole record a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from mp_toolkit.run import loggers
from tests.cli_helpers import assert_one_line_exit_2
from tests.mpt_command import run_mpt

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def log_records(path: Path):
    """The records of a ``.wandb`` file, as bytes."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, chunks = 7, []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's trailer
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:  # zero fill: the end of what was written
            return
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (FULL, LAST):
            yield b"".join(chunks)
            chunks = []


def history(path: Path) -> list[dict]:
    """The rows the run logged (``wandb.log``), in order, as {key: value}."""
    from wandb.proto import wandb_internal_pb2  # the package is optional: imported by the test that has it

    rows = []
    for raw in log_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_a_deepspeed_wandb_section_logs_every_row_offline_on_rank_0(tmp_path):
    pytest.importorskip("wandb")
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                                  "wandb": {"enabled": True, "project": "smoke"}}))
    r = run_mpt(["train", "--config", "ds.json", "--model", "gpt-tiny", "--data", "synthetic", "--seq-len", "16",
                 "--steps", "4", "--threads", "1", "--no-progress", "--pp", "2", "--eval-every", "2",
                 "--eval-batches", "1", "--metrics", "m.jsonl"], cwd=tmp_path, timeout=240,
                env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0's only
    logged = history(next(runs[0].glob("run-*.wandb")))
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [row["_step"] for row in logged] == [row["step"] for row in rows] == [1, 2, 3, 4]
    for got, row in zip(logged, rows):
        assert (got["train/loss"], got["train/lr"], got["train/grad_norm"]) == (
            row["loss"], row["lr"], row["grad_norm"])
        assert ("val/loss" in got) == ("val_loss" in row) == (row["step"] % 2 == 0)
        if "val_loss" in row:
            assert (got["val/loss"], got["val/ppl"]) == (row["val_loss"], row["val_ppl"])
    assert {"memory/peak_rss_rank0_mib", "memory/peak_rss_rank1_mib"} <= logged[-1].keys()


def test_wandb_without_the_package_is_refused_naming_the_key(tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else
                        find_spec(name, *a))
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                  "wandb": {"enabled": True}}))
    assert_one_line_exit_2(capsys, ["train", "--config", str(config), "--model", "gpt-tiny", "--data", "synthetic",
                                    "--seq-len", "16", "--pp", "2"],
                           mentions="wandb.enabled is true but the wandb package is not installed")
