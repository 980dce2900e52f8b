"""Capture and restore the random-number generators of one process (one global rank).

RNG state is per rank: dropout masks, data shuffles and initialisations drawn on rank r depend
on rank r's generators. Restoring it is therefore exact only when the run resumes on the same
layout (same world size, same rank doing the same work); on another layout the model, optimizer
and data position still resume exactly but random draws differ from the uninterrupted run.

What is captured: torch's CPU generator (a uint8 tensor), each CUDA device's generator when CUDA
is already initialised in this process (capturing never initialises CUDA, which would create a
context on a GPU the rank does not use), Python's `random` and numpy's legacy global generator
(`np.random.seed` / `np.random.rand`). Generators a program builds itself
(``torch.Generator()``, ``np.random.default_rng()``) are its own to save.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from mp_toolkit.checkpoint.files import CheckpointError


@dataclass
class RngState:
    """One rank's generators: ``tensors`` (``"torch.cpu"``, ``"torch.cuda.<i>"``: uint8 states,
    stored as safetensors) and ``data`` (``"python"``, ``"numpy"``: JSON-able lists and numbers)."""

    tensors: dict[str, torch.Tensor]
    data: dict


def capture_rng() -> RngState:
    """The current state of every generator listed in the module docstring."""
    tensors = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            tensors[f"torch.cuda.{i}"] = torch.cuda.get_rng_state(i)
    version, internal, gauss_next = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    data = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {"bit_generator": name, "key": key.tolist(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    return RngState(tensors, data)


def restore_rng(state: RngState) -> None:
    """Put every generator back where `capture_rng` found it.

    CUDA states are restored for the devices present (lazily, without initialising CUDA); a
    checkpoint from a GPU run restored on a CPU-only machine skips them.
    """
    try:
        py, npy = state.data["python"], state.data["numpy"]
        gauss_next = None if py["gauss_next"] is None else float(py["gauss_next"])
        py_state = (int(py["version"]), tuple(int(x) for x in py["state"]), gauss_next)
        np_state = (str(npy["bit_generator"]), np.asarray(npy["key"], dtype=np.uint32), int(npy["pos"]),
                    int(npy["has_gauss"]), float(npy["cached_gaussian"]))
        cpu = state.tensors["torch.cpu"]
        cuda = {int(k[len("torch.cuda."):]): v for k, v in state.tensors.items() if k.startswith("torch.cuda.")}
        # Validate everything before setting anything, so a bad state changes no generator.
        probe = random.Random()
        probe.setstate(py_state)
        np.random.RandomState().set_state(np_state)
        torch.Generator().set_state(cpu)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"RNG state is malformed ({' '.join(str(e).split())})") from None
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(cpu)
    if cuda and torch.cuda.is_available():
        for index, value in cuda.items():
            if index < torch.cuda.device_count():
                torch.cuda.set_rng_state(value, index)
