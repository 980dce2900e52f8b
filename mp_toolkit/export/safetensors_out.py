"""Safetensors files written one tensor at a time, in shards above a size, as ``save_pretrained`` names them.

    w = ShardedSafetensors(out_dir, max_shard_bytes=parse_size("5GB"))
    for key, tensor in tensors():      # e.g. one checkpoint layer after another
        w.add(key, tensor)             # nothing but this tensor is held
    w.close()   # -> model.safetensors, or model-00001-of-0000N.safetensors ... + model.safetensors.index.json

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the bytes. The header must precede data whose size is known only
once the shard is full, so each shard's bytes go first to a scratch file beside it and are copied in
1 MiB pieces behind the header when the shard closes: memory holds one tensor and one piece, at the
cost of writing the bytes twice. A tensor larger than the limit gets a shard of its own (as
``save_pretrained`` does). Files are named when the count is known, at `close`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_PIECE = 1 << 20


def parse_size(text: str | int) -> int:
    """Bytes of ``"5GB"`` (10**9 units, as transformers reads them), ``"500MiB"`` (2**20) or a plain integer."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
        if m is None:
            raise ValueError(f"size {text!r} is not a number of bytes with an optional unit (e.g. 5GB, 500MiB)")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return value


class ShardedSafetensors:
    """Writes ``add``-ed tensors into ``out_dir`` (see the module docstring); ``close`` names the files
    and writes the index when there is more than one. ``metadata`` goes into every header
    (``{"format": "pt"}``, which ``from_pretrained`` requires)."""

    def __init__(self, out_dir, max_shard_bytes: int, metadata: dict[str, str] | None = None):
        self.out = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards: list[Path] = []
        self.weight_map: dict[str, int] = {}  # key -> shard index
        self.total_bytes = 0
        self._entries: dict[str, dict] = {}
        self._data = None  # the open scratch file of the current shard
        self._size = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self.weight_map:
            raise ValueError(f"{key} was written already")
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"{key}: safetensors has no dtype for {tensor.dtype}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        if self._data is not None and self._size and self._size + data.nbytes > self.max_shard_bytes:
            self._finish_shard()
        if self._data is None:
            self._data = open(self.out / f".shard-{len(self.shards) + 1:05d}.data", "wb")
        self._entries[key] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self._size, self._size + data.nbytes]}
        self._data.write(memoryview(data))  # no copy of the tensor's bytes
        self._size += data.nbytes
        self.total_bytes += data.nbytes
        self.weight_map[key] = len(self.shards)

    def _finish_shard(self) -> None:
        scratch = Path(self._data.name)
        self._data.close()
        self._data = None
        header = json.dumps({"__metadata__": self.metadata, **self._entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        path = self.out / f".shard-{len(self.shards) + 1:05d}.safetensors"
        with open(path, "wb") as f, open(scratch, "rb") as src:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            shutil.copyfileobj(src, f, _PIECE)
            f.flush()
            os.fsync(f.fileno())
        scratch.unlink()
        self.shards.append(path)
        self._entries, self._size = {}, 0

    def close(self, total_parameters: int | None = None) -> list[str]:
        """Finish the last shard, give the files their final names; the names written."""
        if self._data is not None:
            self._finish_shard()
        n = len(self.shards)
        names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for path, name in zip(self.shards, names):
            path.rename(self.out / name)
        if n > 1:
            meta = {"total_size": self.total_bytes}
            if total_parameters is not None:
                meta = {"total_parameters": total_parameters, **meta}
            index = {"metadata": meta, "weight_map": {k: names[i] for k, i in sorted(self.weight_map.items())}}
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            names.append(INDEX_FILE)
        return names

    def abort(self) -> None:
        """Remove what was written (the caller's directory stays)."""
        if self._data is not None:
            self._data.close()
            Path(self._data.name).unlink(missing_ok=True)
            self._data = None
        for path in self.shards:
            path.unlink(missing_ok=True)
