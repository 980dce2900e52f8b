"""`tools.gpu_check`'s CPU dry run (issue 23) and the pieces of the CUDA paths that run without a GPU.

The dry run here takes the in-process sections (memory, the precision oracle, the throughput run of
`mpt train`, LAMB against the copy bandwidth) and checks the JSON they write, and the pp=2 oracle,
whose two ranks the launcher every tool uses starts (`tools.ranks`); `mpt train` at pp=2 runs in
``tools/gpu_check.sh --dry-run`` (about two minutes) and, on a GPU, in the full check. No figure is
compared with a time.
"""
import json
import math

import torch

from model_zoo.gpt import GPT, PRESETS
from mp_toolkit.parallel.host_staging import HostStagedP2P, make_p2p
from mp_toolkit.parallel.p2p import P2P
from mp_toolkit.run.launch import device_and_backend
from tests.dist_harness import run_world
from tests.p2p_workers import swap_messages
from tools import gpu_check


def test_dry_run_writes_the_json_and_summary(tmp_path, monkeypatch):
    # mpt train runs in this process: leave glibc's heap and torch's thread count as other tests expect
    monkeypatch.setenv("MPT_KEEP_FREED_MEMORY", "0")
    threads = torch.get_num_threads()
    try:
        code = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "memory", "precision", "throughput",
                               "lamb"])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0 and report["ok"] and report["dry_run"], report
    assert report["device"]["device"] == "cpu" and report["device"]["peak_tflops"] is None
    assert set(report) >= {"memory", "precision", "throughput", "lamb"} and "oracle" not in report
    assert report["memory"]["peak_rise_mib"] >= 60  # the 64 MiB tensor, seen through DeviceMemory
    for name, v in report["precision"]["precisions"].items():
        # low precision moves the weights away from fp32, here by exactly the CPU floor (same kernels)
        assert 0 < v["distance_from_fp32"] == v["cpu_floor"] and v["ok"], (name, v)
    run = report["throughput"]["models"]["gpt-tiny"]
    assert run["exit"] == 0 and run["tokens_per_s"] > 0 and run["mfu"] is None  # no peak on CPU
    assert run["flops_per_token"] == 6 * (4 * 12 * 32 * 32 + 256 * 32) + 12 * 4 * 32 * 32
    assert math.isclose(run["achieved_tflops"], run["tokens_per_s"] * run["flops_per_token"] / 1e12)
    lamb = report["lamb"]
    assert lamb["params"] == sum(math.prod(s) for s in gpu_check.lamb_shapes(gpu_check.Sizes.for_run(True).lamb_shapes))
    assert lamb["copy_GBps"] > 0 and math.isclose(lamb["x_bound"], lamb["lamb_ms"] / lamb["bound_ms"])
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "dry run" in text and text.rstrip().endswith("overall: ok")


def test_dry_run_oracle_ranks_started_by_the_tools_launcher_are_bitwise(tmp_path):
    """pp=2 on two ranks that `tools.ranks.run_ranks` starts (fresh interpreters, torchrun's variables,
    gloo), against one process: every parameter and loss bitwise equal (DESIGN.md invariant 1)."""
    code = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "oracle"])
    oracle = json.loads((tmp_path / "gpu_check.json").read_text())["oracle"]
    assert code == 0 and oracle["ok"], oracle
    assert (oracle["backend"], oracle["devices"], oracle["unequal"]) == ("gloo", ["cpu", "cpu"], []), oracle
    assert oracle["tensors"] == len(list(GPT(gpu_check.Sizes.for_run(True).oracle).parameters()))
    assert oracle["max_abs_diff"] == 0.0 and oracle["losses"] == oracle["reference_losses"], oracle


def test_device_peaks_by_name_and_flops_per_token():
    assert gpu_check.device_peak("NVIDIA H200")[0]["bf16"] == 989.4
    assert gpu_check.device_peak("NVIDIA H100 PCIe")[1] == "H100 PCIe"  # before the SXM row
    assert gpu_check.device_peak("NVIDIA A100-SXM4-80GB")[0]["bf16"] == 312.0
    assert gpu_check.device_peak("Some Future GPU") == (None, None)
    # GPT-2 small at 1024: 6 x 123.5M matmul parameters + attention, ~0.85 GFLOP per token
    assert gpu_check.flops_per_token(PRESETS["gpt2"], 1024) == 854_438_400


def test_backend_per_device_count():
    cpu, cuda = torch.device("cpu"), torch.device
    assert device_and_backend(1, 2, 0) == (cpu, "gloo")
    assert device_and_backend(1, 2, 2) == (cuda("cuda", 1), "nccl")  # a GPU per local rank
    assert device_and_backend(1, 2, 1) == (cuda("cuda", 0), "gloo")  # two ranks share one GPU: NCCL refuses
    assert device_and_backend(3, 4, 2) == (cuda("cuda", 1), "gloo")


def test_host_staged_transport_carries_messages():
    assert type(make_p2p(torch.device("cpu"))) is P2P  # gloo carries CPU tensors: nothing to stage
    (specs0, got0, sent0), (specs1, got1, sent1) = run_world(swap_messages, 2, HostStagedP2P, timeout_s=60)
    assert specs1 == specs0
    assert torch.equal(got0[0], torch.full((2, 3), 1.0)) and torch.equal(got1[1], torch.arange(4))
    assert got0[2].tolist() == [True, True] and got1[2].dtype == torch.bool
    assert sent0 == sent1 == 2 * 3 * 4 + 4 * 8 + 2
