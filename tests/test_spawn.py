"""`mpt train` starting its own ranks (`mp_toolkit.run.spawn`): forked from the mpt command, or
fresh interpreters when `main` is called from Python; both train alike, and so does an `mpt` forked
from the test session's server (`tests/mpt_command.py`, how most tests start it).

The forks happen in child interpreters started here, never in the pytest worker (which holds
threads a fork would not carry).
"""

import json
import subprocess
import sys

from tests.mpt_command import run_mpt

TRAIN = ["train", "--model", "gpt-tiny", "--data", "synthetic", "--seq-len", "16", "--micro-batch", "2",
         "--microbatches", "3", "--threads", "1", "--no-progress", "--pp", "2", "--steps", "3", "--lr", "1e-2"]

FORKING = """
import os, sys
from mp_toolkit.run.spawn import spawn_local

def entry(argv):
    rank = int(os.environ["RANK"])
    name = open("/proc/self/comm").read().strip()
    assert name == f"mpt rank {rank}", name
    assert (os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"]) == (
        "2", str(rank), "127.0.0.1")
    os.write(int(os.environ["MPT_STATUS_FD"]), f"while saying {argv[0]}\\n".encode())
    if rank == 1 and argv[0] == "fail":
        raise RuntimeError("rank 1 fails on purpose")
    if rank == 0 and argv[0] == "exit":
        sys.exit(7)
    return 0

sys.exit(spawn_local([sys.argv[1]], 2, fork_with=entry, grace_s=2.0))
"""


def _spawn(word: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FORKING, word], capture_output=True, text=True, timeout=120)


def test_forked_ranks_get_a_launchers_environment_and_name():
    done = _spawn("ok")
    assert done.returncode == 0, done.stderr


def test_an_exception_escaping_a_forked_rank_is_printed_and_named_by_the_watchdog():
    done = _spawn("fail")
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: rank 1 fails on purpose" in done.stderr
    assert "mpt train: rank 1 failed (exit code 1) while saying fail; stopping ranks 0" in done.stderr


def test_a_forked_rank_exits_with_its_own_code():
    done = _spawn("exit")
    assert done.returncode == 7, done.stderr
    assert "rank 0 failed (exit code 7)" in done.stderr


def _losses(metrics) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def test_forked_ranks_and_fresh_interpreters_train_bitwise_alike(tmp_path):
    forked, fresh = tmp_path / "forked.jsonl", tmp_path / "fresh.jsonl"
    runs = [
        [sys.executable, "-m", "mp_toolkit.cli", *TRAIN, "--metrics", str(forked)],  # the mpt command: forks
        [sys.executable, "-c", "import sys; from mp_toolkit.cli import main; sys.exit(main(sys.argv[1:]))",
         *TRAIN, "--metrics", str(fresh)],  # main from Python: each rank a fresh interpreter
    ]
    for cmd in runs:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr
    assert len(_losses(forked)) == 3
    assert _losses(forked) == _losses(fresh)
    # how most tests start mpt: forked from the session's pre-imported server (tests/mpt_command.py)
    served = tmp_path / "served.jsonl"
    done = run_mpt([*TRAIN, "--metrics", str(served)], timeout=240)
    assert done.returncode == 0, done.stderr
    assert _losses(served) == _losses(forked)


def test_a_served_command_exits_and_prints_as_the_mpt_script():
    """tests/mpt_command.py against ``python -m mp_toolkit.cli``: the same exit code and output for a
    refused flag and for ``mpt plan``."""
    for argv in (["train", "--pp", "0", "--model", "gpt-tiny"],
                 ["plan", "--model", "gpt-tiny", "--pp", "2", "--seq-len", "32", "--tflops", "1"]):
        fresh = subprocess.run([sys.executable, "-m", "mp_toolkit.cli", *argv], capture_output=True, text=True,
                               timeout=120)
        served = run_mpt(argv, timeout=120)
        assert (served.returncode, served.stdout, served.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 0 and served.stdout
