"""Transport of tensor tuples between ranks, and the rank grid's axis order."""

import pytest
import torch

from mp_toolkit.parallel.context import GridError, check_grid, grid_coords, grid_rank
from mp_toolkit.parallel.p2p import RecvBuffers, TensorSpec, decode_specs, encode_specs
from tests.dist_harness import run_world
from tests.p2p_workers import grid, swap_messages


def test_spec_round_trip():
    specs = [TensorSpec((2, 3), torch.float32), TensorSpec((4,), torch.int64), TensorSpec((), torch.bool),
             TensorSpec((1, 2, 3, 4), torch.bfloat16)]
    assert decode_specs(encode_specs(specs)) == specs


def test_batched_swap_carries_float_int_and_bool():
    (specs0, got0, sent0), (specs1, got1, sent1) = run_world(swap_messages, 2, timeout_s=60)
    assert specs1 == specs0  # rank 1 learned rank 0's specs from the metadata message
    assert torch.equal(got0[0], torch.ones(2, 3)) and torch.equal(got1[0], torch.zeros(2, 3))
    assert torch.equal(got0[1], torch.arange(4) + 10) and torch.equal(got1[1], torch.arange(4))
    assert got0[2].dtype == torch.bool and got0[2].tolist() == [True, True]
    assert got1[2].tolist() == [True, False]
    assert sent0 == sent1 == 2 * 3 * 4 + 4 * 8 + 2  # payload bytes: fp32, int64, bool


def test_receive_buffers_are_reused_only_when_nothing_holds_them():
    """A receive buffer is handed out again only once no alias of it lives (issue 23 item 3): not the
    message, not a detached leaf or a view of it (a saved tensor, a gradient), not autograd's copy."""
    pool = RecvBuffers(torch.device("cpu"))
    a = pool.take((2, 3), torch.float32)
    b = pool.take((2, 3), torch.float32)  # a is held: a second buffer
    assert a.data_ptr() != b.data_ptr() and pool.allocated == 2
    leaf = a.detach().requires_grad_()  # what the next stage computes from
    saved = (leaf * 2).sum()  # autograd keeps leaf for the backward
    del a, b
    c = pool.take((2, 3), torch.float32)  # b's buffer is free again, a's is still held by the graph
    assert pool.allocated == 2 and pool.reused == 1 and c.data_ptr() != leaf.data_ptr()
    first = leaf.data_ptr()
    grad_view = leaf.detach()[1]  # a view of it, as a gradient that aliases a message could be
    del leaf, saved, c
    d = pool.take((2, 3), torch.float32)  # the view still holds the first buffer: the second comes back
    assert d.data_ptr() != first and pool.allocated == 2
    del d, grad_view
    ptrs = {pool.take((2, 3), torch.float32).data_ptr() for _ in range(3)}  # each dropped at once
    assert ptrs == {first} and pool.allocated == 2  # no new allocation once everything is released
    assert pool.take((4,), torch.float32).shape == (4,) and pool.allocated == 3  # another shape: its own


def test_axis_order_tp_fastest():
    # world 8 = pp 2 x tp 2 x dp 2: ranks 0,1 are tp peers; 0,2 dp peers; 0,4 pipeline neighbours
    assert grid_coords(1, 2, 2, 2) == (0, 1, 0)
    assert grid_coords(2, 2, 2, 2) == (0, 0, 1)
    assert grid_coords(4, 2, 2, 2) == (1, 0, 0)
    for r in range(8):
        assert grid_rank(*grid_coords(r, 2, 2, 2), 2, 2) == r


def test_grid_mismatch_is_readable():
    with pytest.raises(GridError, match="does not match the world size 4"):
        check_grid(4, 3, 1, 1)


def test_context_on_four_ranks():
    out = run_world(grid, 4, 4, 1, 1, timeout_s=60)
    assert [o[0] for o in out] == [0, 1, 2, 3]
    assert out[0][3] is None and out[0][4] == 1 and out[3][4] is None and out[2][3] == 1
    assert out[1][5] == (0, 1, 2, 3)
    assert out[0][6] and out[3][7] and not out[1][6]
