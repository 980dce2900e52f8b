"""Issue 39, item 3: ``--check-replicas N`` finds a flipped bit in one data-parallel replica.

Real ranks (`mpt train` starting them) on gpt-tiny, synthetic data; the fault is the test-only
``MPT_FAULTS`` ``flip`` (one bit of one element of one tensor, after one step's update, on one rank).
"""

import pytest
import torch

from mp_toolkit.checkpoint import latest_step
from mp_toolkit.run.launch import EXIT_REPLICAS
from mp_toolkit.run.replicas import digest
from tests.fault_workers import Job, differing, mpt_job, tensors
from tests.test_fault_tolerance import finish

CHECKED = ("--dp", "2", "--check-replicas", "2", "--save-every", "2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_a_digest_sees_every_bit(dtype):
    """Equal bytes hash equal; flipping any one bit of any element changes the hash."""
    t = (torch.randn(5, 3) * 100).to(dtype)
    assert digest(t) == digest(t.clone()) == digest(t.clone().t().contiguous().t())
    width = t.element_size() * 8
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    for element in (0, 7, 14):
        for bit in range(width):
            flipped = t.clone()
            view = flipped.view(ints).reshape(-1)
            view[element] ^= (1 << bit) - (1 << width if bit == width - 1 else 0)
            assert digest(flipped) != digest(t), (element, bit)


def job_of(tmp_path, *args, faults=None) -> Job:
    return mpt_job(tmp_path, *CHECKED, "--save-dir", str(tmp_path / "ck"), *args, faults=faults)


def test_a_flipped_master_bit_stops_every_rank_before_the_save(tmp_path):
    """Rank 3 (stage 1, replica 1) flips the lowest bit of a master after step 3: the check after step 4
    names the step, the stage, the tensor and the replica; step 4 is not saved; exit 6, one line."""
    job = job_of(tmp_path, faults={"flip": [{"rank": 3, "step": 3, "tensor": 0, "element": 5, "bit": 0}]})
    assert finish(job, 240) == EXIT_REPLICAS, job.stderr
    errors = [line for line in job.stderr.splitlines() if line.startswith("mpt train")]
    assert len(errors) == 1, job.stderr
    assert errors[0].startswith("mpt train: error: replica check after step 4: stage 1, parameter "), errors
    assert "data-parallel replica 1 (rank 3) differs from replica 0 (rank 2)" in errors[0], errors
    assert latest_step(tmp_path / "ck") == 2


def test_restarts_resume_from_the_checked_checkpoint_bitwise(tmp_path):
    """With --restarts 1 the job goes on from step 2 (checked before it was saved) and ends bitwise as a
    run without the flip."""
    clean = tmp_path / "clean"
    clean.mkdir()
    assert finish(job_of(clean), 240) == 0
    job = job_of(tmp_path, "--restarts", "1",
                 faults={"flip": [{"rank": 1, "step": 3, "tensor": 1, "element": 0, "bit": 30}]})
    assert finish(job, 240) == 0, job.stderr
    assert "replica check after step 4: stage 0, " in job.stderr and "restart 1 of 1: resuming from step-00000002" \
        in job.stderr, job.stderr
    assert latest_step(tmp_path / "ck") == 8
    assert differing(tensors(tmp_path / "ck"), tensors(clean / "ck")) == []


@pytest.mark.parametrize("extra", [("--precision", "bf16"), ("--precision", "fp16"), ("--zero", "1")],
                         ids=["bf16", "fp16", "zero1"])
def test_clean_runs_pass_every_check(tmp_path, extra):
    """No false alarm: a check after every step of bf16, fp16 (its loss scaler) and ZeRO-1 runs."""
    job = mpt_job(tmp_path, "--dp", "2", "--pp", "1", "--check-replicas", "1", *extra)
    assert finish(job, 240) == 0, job.stderr
