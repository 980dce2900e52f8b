"""`StageMemory`'s accumulation temporaries: after a step's first micro-batch, a layer's backward
hands each gradient to ``.grad`` as a temporary (``grad += new``), the largest of them on top of
the layer's workspace while it runs."""

from mp_toolkit.partition.memory import StageMemory, min_memory_cut

ARGS = dict(static=[100, 10, 10, 60], activation=[1, 2, 2, 3], inflight=[2, 1], workspace=[0, 4, 4, 30],
            fixed=7, step_transient=[0, 0, 0, 0])


def test_the_running_layer_adds_its_workspace_and_its_accumulation_temporary():
    one_mb, several = StageMemory(**ARGS), StageMemory(**ARGS, accumulated=[0, 8, 8, 50])
    # stage 1 over layers 2..3: kept 1 x (2 + 3); the LM head-like layer 3 runs with 30 + 50 beside it
    assert one_mb(1, 2, 4) == 70 + 1 * 5 + 30 + 7
    assert several(1, 2, 4) == 70 + 1 * 5 + (30 + 50) + 7
    # the largest sum counts, not the largest of each: layer 1's 4 + 8 beats layer 0's 0 + 0
    assert several(0, 0, 2) == 110 + 2 * 3 + 12 + 7 and several.transient(0, 2) == 12
    # a rank of several chunks runs one backward at a time: one temporary, as one workspace
    assert several.of_rank([(0, 0, 1), (1, 3, 4)]) == 160 + (2 * 1 + 1 * 3) + 80 + 7


def test_the_step_still_counts_when_its_temporaries_are_larger():
    mem = StageMemory(**{**ARGS, "step_transient": [0, 0, 0, 200]}, accumulated=[0, 8, 8, 50])
    assert mem(1, 3, 4) == 60 + 200 + 7


def test_the_leanest_cut_moves_away_from_a_large_temporary():
    """Layer 3's temporary (the LM head's (V, C) gradient) makes its stage the largest: the leanest
    cut of 4 layers into 2 stages then gives it the fewest other layers."""
    assert min_memory_cut(StageMemory(**ARGS), 4, 2) == (124, [0, 1, 4])  # max(109, 80 + 7 + 30 + 7)
    assert min_memory_cut(StageMemory(**ARGS, accumulated=[0, 0, 0, 90]), 4, 2) == (190, [0, 3, 4])  # 60 + 3 + 120 + 7
