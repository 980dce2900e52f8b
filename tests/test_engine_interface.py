"""Both engines `mpt train` can run implement `TrainEngine`, the interface its loop and checkpoints use."""

import inspect

import pytest

from mp_toolkit.engine.deepspeed_bridge import DeepSpeedPipeline
from mp_toolkit.engine.interface import TrainEngine
from mp_toolkit.engine.pipeline import PipelineEngine

CALLS = sorted(n for n, v in vars(TrainEngine).items()
               if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property)))


def test_the_interface_names_what_the_loop_and_checkpoints_call():
    assert CALLS == ["copy_back", "eval_batch", "layer_names", "master_of", "named_parameters", "scaler",
                     "train_batch", "trust_ratio_stats"]
    assert set(TrainEngine.__annotations__) == {"boundaries", "optimizer"}


@pytest.mark.parametrize("engine", [PipelineEngine, DeepSpeedPipeline])
def test_engine_implements_every_call_with_the_same_parameters(engine):
    for name in CALLS:
        ours, spec = getattr(engine, name), getattr(TrainEngine, name)
        assert isinstance(ours, property) == isinstance(spec, property), name
        if not isinstance(spec, property):
            assert list(inspect.signature(ours).parameters)[:2] == list(inspect.signature(spec).parameters)[:2], name
