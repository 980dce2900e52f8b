"""The safetensors files of a save_pretrained directory, read one tensor (or slices of one) at a time.

A directory holds ``model.safetensors`` or, as every model over ~5 GB is published, shards named by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``); like
``from_pretrained``, the single file wins when both are there. `SafetensorsFiles` knows which file
holds a tensor from the index (or the one file's header) and parses a file's header (an 8-byte
little-endian length, then JSON: name -> dtype, shape, data_offsets) when a tensor in it is first
asked for. A tensor is read through ``safe_open(file, "pt").get_slice(name)``, which maps the file
and copies only the rows / columns asked for. So a rank asking for its own layers' tensors (of
those, its tensor-parallel slices) opens only the shards that hold them and reads only their bytes.
The file is opened for each read and closed after: the pages of a mapped file count in the
process's resident memory for as long as it stays mapped, so a file kept open would hold the
rank's share twice (measured: gpt2-large at pp=4 from 1 GB shards, 0.45-0.98 GB more per rank
before the first step).

Every problem is a `WeightsError`, one line naming the file and the tensor: an index that names a
file the directory lacks, a header that does not parse, a file shorter than its header says, a
tensor the file does not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mp_toolkit.checkpoint.files import MAX_HEADER, parse_header
from mp_toolkit.user_files import link_note, parse_json, special_kind

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
AGAIN = "save the model again with save_pretrained (or download it again)"


class WeightsError(ValueError):
    """A tensor a directory's weights cannot give (one line: the file, the tensor, what is wrong)."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its file, and its shape and dtype as the file's header gives them."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


class SafetensorsFiles:
    """The tensors of ``model.safetensors`` or of an index's shards, by HF name; read lazily.

        files = SafetensorsFiles("runs/llama-init")
        files.entry("model.embed_tokens.weight").shape        # from the header only
        files.read("model.layers.0.mlp.up_proj.weight", dim=0, ranges=[(0, 64)])   # rows 0..63
    """

    def __init__(self, directory):
        self.directory = Path(directory)
        self._headers: dict[str, dict[str, TensorEntry]] = {}

    @cached_property
    def file_of(self) -> dict[str, str]:
        """HF tensor name -> the file (a name inside the directory) that holds it."""
        if (self.directory / SINGLE).is_file():
            return dict.fromkeys(self._header(SINGLE), SINGLE)
        index = self.directory / INDEX
        if not index.is_file():
            raise WeightsError(f"{self.directory} has neither {SINGLE} nor {INDEX}: "
                               "save the model with save_pretrained")
        try:
            weight_map = parse_json(index.read_text(encoding="utf-8"))["weight_map"]
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise ValueError("its names and files must be strings")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{index} is not a safetensors index ({type(e).__name__}: {e}): it must hold "
                               '{"weight_map": {tensor name: shard file}}') from None
        for name, file in weight_map.items():  # safetensors only, and only files of this directory
            if not file.endswith(".safetensors") or Path(file).name != file or file.startswith("."):
                raise WeightsError(f"{index} places tensor {name} in {file!r}: only .safetensors files of "
                                   f"{self.directory} itself are read (pickled .bin weights never are)")
        return dict(weight_map)

    @property
    def origin(self) -> Path:
        """What says where the tensors are: the index, or the single file."""
        return self.directory / (SINGLE if (self.directory / SINGLE).is_file() else INDEX)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def entry(self, name: str) -> TensorEntry:
        """Tensor ``name``'s file, shape and dtype; WeightsError when the directory does not hold it."""
        if name not in self.file_of:
            raise WeightsError(f"{self.origin} has no tensor {name}")
        file = self.file_of[name]
        header = self._header(file)
        if name not in header:
            raise WeightsError(f"{self.directory / file} has no tensor {name}, though {INDEX} places it there: {AGAIN}")
        return header[name]

    def read(self, name: str, dim: int = 0, ranges: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
        """Tensor ``name`` as the file stores it: whole, or the [start, stop) ``ranges`` of dim ``dim``
        concatenated in order (a tensor-parallel shard: `mp_toolkit.parallel.tensor_parallel.shard_ranges`)."""
        entry = self.entry(name)
        try:
            with safe_open(str(entry.file), "pt") as f:  # mapped for this read only (see the module docstring)
                if ranges is None:
                    return f.get_tensor(name)
                part = f.get_slice(name)
                lead = (slice(None),) * dim  # part[:, a:b] for dim 1
                return torch.cat([part[(*lead, slice(start, stop))] for start, stop in ranges], dim=dim)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise WeightsError(f"{entry.file}: cannot read tensor {name} ({str(e).splitlines()[0]}): {AGAIN}") from None

    def _header(self, file: str) -> dict[str, TensorEntry]:
        """The tensors ``file``'s header lists; WeightsError when the file is missing, unreadable or
        shorter than the header says (a truncated download or copy)."""
        if file in self._headers:
            return self._headers[file]
        path = self.directory / file
        expected = self._a_tensor_in(file)
        if not path.is_file():
            raise WeightsError(f"{self.directory / INDEX} places tensor {expected} in {file}, but {self.directory} "
                               f"has no such file: copy every shard the index names")
        holds = f" (it should hold {expected})" if expected else ""
        kind = special_kind(path)
        if kind is not None:
            raise WeightsError(f"{path}{link_note(path)} is {kind}, not a safetensors file: {AGAIN}")
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                head += f.read(min(int.from_bytes(head, "little"), MAX_HEADER)) if len(head) == 8 else b""
            n, header, _ = parse_header(head, size)
        except (OSError, ValueError) as e:
            raise WeightsError(f"{path}{link_note(path)}: no readable safetensors header ({e}){holds}; the file is "
                               f"truncated or is not safetensors: {AGAIN}") from None
        entries = {name: (TensorEntry(path, tuple(e["shape"]), e["dtype"]), e["data_offsets"][1])
                   for name, e in header.items()}
        data = size - 8 - n
        short = sorted((end, name) for name, (_, end) in entries.items() if end > data)
        if short:
            end, name = short[0]
            raise WeightsError(f"{path} is truncated: tensor {name} ends at byte {end} of its data but the file "
                               f"holds {data}: {AGAIN}")
        self._headers[file] = {name: entry for name, (entry, _) in entries.items()}
        return self._headers[file]

    def _a_tensor_in(self, file: str) -> str | None:
        """The first tensor the index places in ``file`` (for messages); None for the single file."""
        if "file_of" not in self.__dict__:  # the single file, read to build file_of
            return None
        return next((name for name, f in self.file_of.items() if f == file), None)

