"""Helpers shared by the checkpoint tests."""

import hashlib
import json
from pathlib import Path

import torch

torch.set_num_threads(1)


def raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes, so equality is bitwise (NaN payloads and -0.0 included)."""
    return bytes(t.contiguous().flatten().view(torch.uint8).tolist())


def assert_bitwise(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
        assert raw(a[k]) == raw(b[k]), k


def sample_layers() -> dict:
    g = torch.Generator().manual_seed(0)
    weird = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, 3.0])
    qkv = torch.randn(6, 4, generator=g)
    return {
        "embed": {"embed.wte.weight": torch.randn(10, 4, generator=g),
                  "embed.ids": torch.arange(-5, 5, dtype=torch.int64) * (2 ** 40)},
        "h.0": {"h.0.attn.qkv.weight": qkv.to(torch.bfloat16),
                "h.0.attn.q": qkv[:2],                        # a view: shares storage with qkv
                "h.0.mlp.weight": torch.randn(3, 5, generator=g).half(),
                "h.0.special": weird, "h.0.empty": torch.zeros(0, 3)},
        "h.10": {"h.10.ln.weight": torch.randn(4, generator=g, dtype=torch.float64)},
        "h.2": {"h.2.ln.bias": torch.tensor(7.5)},
    }


def reseal(directory: Path, rel: str) -> None:
    """Rewrite the manifest entry of ``rel`` to the file's current hash: an attacker who
    controls the whole directory, so only parsing stands between the file and the loader."""
    manifest = json.loads((directory / "manifest.json").read_text())
    data = (directory / rel).read_bytes()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def one_line_error(excinfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg
