"""Issue 39, item 1: elastic data parallelism (`mp_toolkit.run.elastic`).

The layout of each start from the launcher's world (in this process), then a node lost and found
again: two torchrun agents (``--nnodes 1:2``, one worker each, c10d rendezvous on 127.0.0.1, agent 0
hosting it) train gpt-tiny at dp 2; agent 1 and its worker are SIGKILLed; agent 0's worker names the
lost rank, the agent meets the rendezvous alone and starts its worker at dp 1, which resumes from the
latest checkpoint with twice the micro-batches; agent 1 started again joins, agent 0 stops its worker
(SIGTERM: it saves the step it is in), and both start at dp 2 from that checkpoint to the end. The
steps trained at dp 1 are bitwise those of a dp 1 run resumed from the same checkpoint.
"""

import json
import sys
import time
from pathlib import Path

import pytest

from mp_toolkit.errors import ConfigError
from mp_toolkit.run.config import TrainConfig
from mp_toolkit.run.elastic import elastic_layout
from mp_toolkit.run.launch import free_port
from tests.fault_workers import TRAIN, Job, mpt_job, rows
from tests.test_fault_tolerance import finish

RDZV = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
"""A lost agent is dropped from the rendezvous after 3 missed keep-alives of 1 s (torch's default: 3 x 5 s)."""
ELASTIC = ["--pp", "1", "--elastic", "1:2", "--global-batch", "12", "--steps", "1500", "--save-every", "10",
           "--keep", "0", "--resume", "auto"]


def test_each_start_takes_dp_from_the_world_and_keeps_the_global_batch(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    cfg = TrainConfig().replace(pp=2, micro_batch=2, elastic=(1, 3), global_batch=12)
    for world, dp, m in ((2, 1, 6), (4, 2, 3), (6, 3, 2)):
        out, line = elastic_layout(cfg, world, dp_given=False)
        assert (out.parallel.dp, out.batch.microbatches) == (dp, m)
        assert line == (f"elastic: world {world} = pp 2 x tp 1 x dp {dp} (--elastic 1:3); global batch 12 = dp {dp} x "
                        f"{m} micro-batches x 2 sequences")
    assert elastic_layout(cfg.replace(elastic=None), 4, False) == (cfg.replace(elastic=None), None)
    refusals = {
        (5, False, cfg): "not a multiple of pp x tp x cp = 2",
        (8, False, cfg): "make dp 4 (pp x tp x cp = 2), outside 1..3",
        (4, False, cfg.replace(global_batch=10)): "--global-batch 10 cannot be split over dp 2 x --micro-batch 2",
        (4, False, cfg.replace(global_batch=None)): "give --global-batch B",
        (4, True, cfg): "drop --dp",
        (None, False, cfg): "mpt train starting the ranks itself gives a fixed world",
    }
    for (world, dp_given, c), words in refusals.items():
        with pytest.raises(ConfigError, match="--elastic 1:3") as e:
            elastic_layout(c, world, dp_given)
        assert words in str(e.value), (world, str(e.value))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        elastic_layout(cfg, 4, False)


def agent(tmp: Path, node: int, endpoint: str, root: Path, name: str) -> Job:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic",
           "--rdzv-conf", f"is_host={int(node == 0)},{RDZV}",
           "--max-restarts", "3", "--monitor-interval", "0.2",
           "-m", "mp_toolkit.cli", *TRAIN, *ELASTIC, "--save-dir", str(root), "--metrics", str(tmp / "m.jsonl")]
    return Job(cmd, tmp, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, name)


def wait_for(what, timeout_s: float, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(poll_s)
    return None


def metrics(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def test_a_lost_agent_shrinks_dp_and_a_returning_one_grows_it_back(tmp_path):
    root, endpoint = tmp_path / "ck", f"127.0.0.1:{free_port()}"
    agents = [agent(tmp_path, 0, endpoint, root, "agent0"), agent(tmp_path, 1, endpoint, root, "agent1")]
    try:
        assert wait_for(lambda: (r := metrics(tmp_path / "m.jsonl")) and r[-1]["step"] >= 25, 240), agents[0].stdout
        killed_at = time.time()
        agents[1].kill()  # the node is gone: its agent and its worker
        trained = wait_for(lambda: [r for r in metrics(tmp_path / "m.jsonl") if r["time"] > killed_at + 1], 240)
        assert trained, agents[0].stdout + agents[0].stderr
        print(f"\nthe survivor trained again {trained[0]['time'] - killed_at:.1f} s after the kill")
        assert wait_for(lambda: len(trained) and metrics(tmp_path / "m.jsonl")[-1]["step"] >= trained[0]["step"] + 5,
                        120)
        agents[1] = agent(tmp_path, 1, endpoint, root, "agent1-again")
        codes = [finish(a, 400) for a in agents]
        logs = "\n".join(f"--- {i}\n{a.stdout[-3000:]}\n{a.stderr[-3000:]}" for i, a in enumerate(agents))
        assert codes == [0, 0], logs
    finally:
        for a in agents:
            a.kill()
    out = agents[0].stdout
    shrunk = out.index("elastic: world 1 = pp 1 x tp 1 x dp 1 (--elastic 1:2); global batch 12 = dp 1 x 6 "
                       "micro-batches x 2 sequences")
    resumed = out[shrunk:].split("resumed from ", 1)[1].split(" at step ")[0]
    err = agents[0].stderr
    assert "lost rank 1 (pid " in err and out.count("elastic: world 2 = pp 1 x tp 1 x dp 2") == 2, out + err
    last_dp1 = int(err.split("mpt train: SIGTERM: every rank stopped after step ", 1)[1].split(" ")[0])
    first_dp1 = int(resumed.rsplit("-", 1)[1]) + 1
    got = {r["step"]: r["loss"] for r in rows(tmp_path / "m.jsonl")}
    assert sorted(got) == list(range(1, 1501))

    ref = tmp_path / "ref"
    ref.mkdir()
    job = mpt_job(ref, "--pp", "1", "--dp", "1", "--microbatches", "6", "--steps", str(last_dp1), "--resume", resumed,
                  "--save-dir", str(ref / "ck"), "--metrics", str(ref / "m.jsonl"))
    assert finish(job, 240) == 0, job.stderr
    want = {r["step"]: r["loss"] for r in rows(ref / "m.jsonl")}
    assert sorted(want) == list(range(first_dp1, last_dp1 + 1))
    assert [got[s] for s in sorted(want)] == [want[s] for s in sorted(want)]
