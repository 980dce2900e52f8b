"""Shared save directories and open ports (issue 22 item 7).

One local 2-rank run serves several checks at once (it is the costly part): every listening socket
of the launcher and its ranks is on 127.0.0.1, the save dir is locked by rank 0 while it runs and a
second run on it is refused. The rest runs in this process.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import torch

from mp_toolkit.checkpoint import begin, commit, latest_step, open_checkpoint, save_checkpoint
from tests.cli_helpers import assert_one_line_exit_2

torch.set_num_threads(1)

TRAIN = ["train", "--model", "gpt-tiny", "--data", "synthetic", "--seq-len", "16", "--micro-batch", "1",
         "--microbatches", "2", "--threads", "1", "--no-progress"]
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _listening(procs) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of ``procs``."""
    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        out += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def test_a_local_run_listens_on_loopback_only_and_locks_its_save_dir(tmp_path, capsys):
    root, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    proc = subprocess.Popen([sys.executable, "-m", "mp_toolkit.cli", *TRAIN, "--pp", "2", "--steps", "100000",
                             "--save-dir", str(root), "--metrics", str(metrics)],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240  # a bound against a hang, not a timing check
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the run did not reach its first step"
            time.sleep(0.2)
        launcher = psutil.Process(proc.pid)
        ranks = launcher.children()
        assert len(ranks) == 2
        sockets = _listening([launcher, *ranks])
        assert sockets and all(ip in LOOPBACK for _, ip, _ in sockets), sockets
        rank0 = next(r for r in ranks if r.name() == "mpt rank 0")  # forked from the mpt command, named so
        assert any(pid == rank0.pid and ip == "127.0.0.1" for pid, ip, _ in sockets)  # it serves the store
        gloo = [(c.laddr.ip, c.raddr.ip) for r in ranks for c in r.net_connections(kind="inet") if c.raddr]
        assert gloo and all(a in LOOPBACK and b in LOOPBACK for a, b in gloo), gloo  # GLOO_SOCKET_IFNAME=lo

        assert (root / ".lock").read_text().strip() == str(rank0.pid)
        line = assert_one_line_exit_2(capsys, [*TRAIN, "--pp", "1", "--steps", "1", "--save-dir", root])
        assert f"--save-dir {root} is in use by another run (pid {rank0.pid}" in line
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()


def test_a_fresh_run_into_a_root_with_checkpoints_is_refused_unless_overwrite(tmp_path, capsys):
    root = tmp_path / "run"
    save_checkpoint(root, 3, {"h.0": {"h.0.w": torch.ones(2)}}, manifest={"run": "earlier"})
    line = assert_one_line_exit_2(capsys, [*TRAIN, "--pp", "1", "--steps", "1", "--save-dir", root])
    assert "holds checkpoints (latest: step 3)" in line and "--overwrite" in line
    from mp_toolkit.cli import main

    assert main([*TRAIN, "--pp", "1", "--steps", "1", "--save-dir", str(root), "--overwrite", "--keep", "1"]) == 0
    assert latest_step(root) == 1
    assert open_checkpoint(root / "step-00000003").manifest == {"run": "earlier"}  # not this run's to prune
    assert not (root / ".lock").exists()  # released at the end


def test_prune_counts_only_this_runs_checkpoints_and_a_save_removes_only_its_own_temp(tmp_path):
    root = tmp_path / "run"
    for step in (1, 2, 3):
        save_checkpoint(root, step, {}, manifest={"run": "a"}, keep=2)
    other = begin(root, 9)  # another job's save in progress
    for step in (4, 5, 6):
        tmp = begin(root, step)
        commit(root, step, tmp, {"run": "b"}, keep=2)
    assert sorted(p.name for p in root.glob("step-*")) == [
        "step-00000002", "step-00000003", "step-00000005", "step-00000006"]
    assert other.is_dir()


def test_export_reads_no_directory_a_manifest_names(tmp_path, capsys):
    """A crafted manifest naming a foreign cache or --hf directory gets no tokenizer from it."""
    from mp_toolkit.cli import main

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "tokenizer.json").write_text("{}")
    manifest = {"config": {"hf": str(foreign), "data": "stdlib", "cache_dir": str(foreign)},
                "hf_config": {"model_type": "gpt2", "vocab_size": 8, "n_positions": 4, "n_embd": 4, "n_layer": 1,
                              "n_head": 1, "architectures": ["GPT2LMHeadModel"]}}
    from transformers import GPT2Config, GPT2LMHeadModel

    from mp_toolkit.checkpoint import split_by_layer
    from mp_toolkit.hf.adapters import from_hf
    from mp_toolkit.hf.common import layer_state_dict

    model = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in manifest["hf_config"].items() if k != "architectures"}))
    layers = from_hf(model)
    state = {k: t.detach() for k, t in layer_state_dict(layers).items() if k != "lm_head.weight"}
    save_checkpoint(tmp_path / "ck", 1, split_by_layer(state, layers.names), manifest=manifest)
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert "no tokenizer: pass --tokenizer" in capsys.readouterr().out
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
