"""Issue 22, item 4: two torchrun agents on one machine, as two nodes of a multi-node job.

`torchrun --nnodes 2 --node-rank {0,1}` with c10d rendezvous on 127.0.0.1 (agent 0 hosts the
store; c10d hands out the ranks itself and says it ignores --node-rank), two workers each: gpt-tiny
at pp=2 x dp=2, saved every 2 steps. Rank 3 (agent 1's second worker) SIGKILLs itself at the start
of step 5: both agents must stop their workers, meet again in the next rendezvous round
(--max-restarts 1) and `--resume auto` must end bitwise as the same layout run once without a
fault.
"""

import json
import sys
from pathlib import Path

from mp_toolkit.checkpoint import open_checkpoint
from mp_toolkit.run.launch import free_port
from tests.fault_workers import TRAIN, Job, differing, mpt_job, rows, tensors

LAYOUT = ("--dp", "2")  # with TRAIN's --pp 2: four ranks, two per agent


def agent(tmp: Path, node: int, endpoint: str, *args: str, faults: dict) -> Job:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", "two-agents", "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=120",
           "--max-restarts", "1", "--monitor-interval", "0.2",
           "-m", "mp_toolkit.cli", *TRAIN, *LAYOUT, *args]
    return Job(cmd, tmp, {"MPT_FAULTS": json.dumps(faults)}, f"agent{node}")


def test_two_agents_stop_together_and_their_restart_resumes_bitwise(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    job = mpt_job(ref, *LAYOUT, "--save-dir", str(ref / "ck"), "--save-every", "2", "--metrics", str(ref / "m.jsonl"))
    try:
        assert job.wait(240) == 0, job.stderr  # 240 s bounds a hang, not a speed
    finally:
        job.kill()

    root, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    endpoint = f"127.0.0.1:{free_port()}"
    common = ("--save-dir", str(root), "--save-every", "2", "--metrics", str(metrics), "--resume", "auto")
    agents = [agent(tmp_path, node, endpoint, *common, faults={"kill": {"rank": 3, "step": 5}})
              for node in (0, 1)]
    try:
        codes = [a.wait(300) for a in agents]
        logs = "\n".join(f"--- agent {i}\n{a.stdout[-2000:]}\n{a.stderr[-4000:]}" for i, a in enumerate(agents))
        assert codes == [0, 0], logs
        assert [a.survivors() for a in agents] == [[], []], logs
    finally:
        for a in agents:
            a.kill()
    out = agents[0].stdout + agents[1].stdout
    assert f"resumed from {root / 'step-00000004'} at step 4" in out, logs
    # each agent saw its own workers fail (rank 3 killed, the others losing it) and restarted them
    assert all("failed (exitcode: " in a.stderr for a in agents), logs
    assert "lost rank 3 (pid " in agents[0].stderr + agents[1].stderr, logs
    got, want = rows(metrics), rows(ref / "m.jsonl")
    assert [r["step"] for r in got] == list(range(1, 9)) and [r["loss"] for r in got] == [r["loss"] for r in want]
    assert open_checkpoint(root).step == 8
    assert differing(tensors(root), tensors(ref / "ck")) == []
