"""Reading a checkpoint: `open_checkpoint` -> `Checkpoint`; every read verifies its file first.

A layer saved on one (pp, tp, dp) layout is read by whichever rank holds it in another: each rank
reads the layers it now owns (``LayerList.names[start:stop]``) and shards them for its TP rank.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mp_toolkit.checkpoint.files import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MAX_MANIFEST,
    SHARD_SUFFIX,
    CheckpointError,
    check_relative,
    file_digest,
    from_json,
    parse_step_dir,
    read_bounded,
    read_shard,
)
from mp_toolkit.checkpoint.rng import RngState
from mp_toolkit.checkpoint.writer import layer_file, optimizer_file, read_latest, replaced_name, rng_file

_HEX64 = re.compile(r"[0-9a-f]{64}")


def _natural(name: str) -> list:
    """Sort key that puts ``h.2`` before ``h.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _parse_manifest(data: bytes, where: str) -> dict:
    """The manifest document after its structure was checked (it is untrusted input too)."""
    try:
        doc = from_json(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{where}: {MANIFEST} is not an mp_toolkit checkpoint manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(f"{where}: {MANIFEST} has format_version {version!r}; this mp_toolkit "
                              f"reads 1..{FORMAT_VERSION} (a newer mp_toolkit wrote it?)")
    if not isinstance(doc.get("step"), int) or doc["step"] < 0 or not isinstance(doc.get("meta"), dict):
        raise CheckpointError(f"{where}: {MANIFEST} lacks an integer step or a meta object")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{where}: {MANIFEST} has no files table")
    for rel, record in files.items():
        try:
            check_relative(rel)
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {MANIFEST} lists an unsafe path: {e}") from None
        if (not isinstance(record, dict) or not isinstance(record.get("sha256"), str)
                or not _HEX64.fullmatch(record["sha256"]) or not isinstance(record.get("bytes"), int)
                or record["bytes"] < 0):
            raise CheckpointError(f"{where}: {MANIFEST} entry for {rel} needs a sha256 and a byte count")
    return doc


@dataclass(frozen=True)
class Checkpoint:
    """One committed checkpoint directory.

    Attributes:
        path: the ``step-XXXXXXXX`` directory.
        step: the training step it was saved at.
        manifest: the caller's dict given to `commit` (config, data position, loss scaler, ...).
        files: ``{relative path: {"sha256", "bytes"}}`` of every shard, as commit listed them.
    """

    path: Path
    step: int
    manifest: dict
    files: dict

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Layers with a model shard, in natural order (``h.2`` before ``h.10``); the model's
        execution order is its LayerList's, not stored here."""
        names = [rel[len("layers/"):-len(SHARD_SUFFIX)] for rel in self.files if rel.startswith("layers/")]
        return tuple(sorted(names, key=_natural))

    @property
    def rng_ranks(self) -> tuple[int, ...]:
        """Global ranks that saved their RNG state."""
        return tuple(sorted(int(rel[len("rng/rank-"):-len(SHARD_SUFFIX)]) for rel in self.files
                            if re.fullmatch(r"rng/rank-\d{5,}\.safetensors", rel)))

    def read_shard(self, rel: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors on CPU, safetensors metadata) of one listed shard, after its hash matched."""
        what = f"{self.path}: shard {rel}"
        record = self.files.get(rel)
        if record is None:
            raise CheckpointError(f"{what}: not in {MANIFEST}")
        return read_shard(self.path / rel, record, what, below=self.path)

    def read_layer(self, name: str) -> dict[str, torch.Tensor]:
        """``{parameter name: full tensor}`` of one layer (names of the unsplit model)."""
        rel = layer_file(name)
        if rel not in self.files:
            have = ", ".join(self.layer_names[:12])
            raise CheckpointError(f"{self.path}: no layer {name!r} (it has {len(self.layer_names)}: {have})")
        return self.read_shard(rel)[0]

    def read_optimizer(self, name: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict]]:
        """(tensors, scalars), each ``{param name: {state key: value}}``, of one layer's optimizer
        state, ready for `load_optimizer_state_by_name`."""
        rel = optimizer_file(name)
        if rel not in self.files:
            raise CheckpointError(f"{self.path}: no optimizer state for layer {name!r}")
        flat, metadata = self.read_shard(rel)
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in flat.items():
            param, _, state_key = key.rpartition(".")  # state keys never contain '.'
            tensors.setdefault(param, {})[state_key] = value
        try:
            scalars = from_json(metadata.get("scalars", "{}"))
        except ValueError as e:
            raise CheckpointError(f"{self.path}: shard {rel}: scalar optimizer state is not valid JSON ({e})") from None
        if not isinstance(scalars, dict) or not all(isinstance(v, dict) for v in scalars.values()):
            raise CheckpointError(f"{self.path}: shard {rel}: scalar optimizer state is not {{param: {{key: value}}}}")
        return tensors, scalars

    def read_rng(self, rank: int) -> RngState:
        """The RNG state global rank ``rank`` saved (exact only when resuming on the same layout)."""
        rel = rng_file(rank)
        if rel not in self.files:
            raise CheckpointError(f"{self.path}: no RNG state for rank {rank} (saved ranks: "
                                  f"{list(self.rng_ranks)[:16]}; was it saved with another world size?)")
        tensors, metadata = self.read_shard(rel)
        try:
            data = from_json(metadata["rng"])
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{self.path}: shard {rel}: RNG metadata is missing or not JSON ({e})") from None
        return RngState(tensors, data)

    def verify(self) -> None:
        """Check the directory is exactly what commit wrote: every listed file exists with its
        size and SHA-256, and no other file is present (an extra file was added after the commit;
        loaders would ignore it, but a checkpoint that changed is not trusted). Reads every byte."""
        for rel, record in self.files.items():
            what = f"{self.path}: shard {rel}"
            try:
                digest, size = file_digest(self.path / rel, below=self.path)
            except CheckpointError as e:
                raise CheckpointError(f"{what}: {str(e).rsplit(': ', 1)[-1]} (listed in {MANIFEST})") from None
            if size != record["bytes"]:
                raise CheckpointError(f"{what}: {size} bytes, {MANIFEST} says {record['bytes']} "
                                      "(file truncated or modified)")
            if digest != record["sha256"]:
                raise CheckpointError(f"{what}: SHA-256 mismatch (file modified or truncated)")
        for dirpath, _, filenames in os.walk(self.path):
            for fname in filenames:
                rel = (Path(dirpath) / fname).relative_to(self.path).as_posix()
                if rel != MANIFEST and rel not in self.files:
                    raise CheckpointError(f"{self.path}: unexpected file {rel} (not in {MANIFEST}: "
                                          "added after the checkpoint was committed)")


def _open_dir(d: Path) -> Checkpoint:
    data = read_bounded(d / MANIFEST, MAX_MANIFEST, f"{d}: {MANIFEST}", below=d)
    if len(data) > MAX_MANIFEST:
        raise CheckpointError(f"{d}: {MANIFEST} is larger than {MAX_MANIFEST} bytes")
    doc = _parse_manifest(data, str(d))
    named_step = parse_step_dir(d.name)
    if named_step is not None and named_step != doc["step"]:
        raise CheckpointError(f"{d}: {MANIFEST} says step {doc['step']}, the directory name says {named_step}")
    return Checkpoint(d, doc["step"], doc["meta"], doc["files"])


def _dangling(root: Path, name: str) -> CheckpointError:
    aside = root / replaced_name(name)
    hint = (f" (a save replacing it was interrupted: the previous copy is {aside}; rename it to "
            f"{name} to resume from it)" if (aside / MANIFEST).is_file() else "")
    return CheckpointError(f"{root / LATEST}: latest names {name} which does not exist{hint}")


def _committed(root: Path) -> Path | None:
    """The directory ``latest`` names, checked to be a checkpoint; None without ``latest``."""
    name = read_latest(root)
    if name is None:
        return None
    if (root / name).is_symlink():
        raise CheckpointError(f"{root / name}: a symbolic link (refused: a checkpoint's folders are its own)")
    if not (root / name).is_dir():
        raise _dangling(root, name)
    if not (root / name / MANIFEST).is_file():
        raise CheckpointError(f"{root / name}: not a checkpoint directory (no {MANIFEST}), yet latest names it")
    return root / name


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """A checkpoint root (follows ``latest``) or one checkpoint directory (that one)."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: {'not a directory' if p.exists() else 'does not exist'}")
    if (p / MANIFEST).exists():
        return _open_dir(p)
    committed = _committed(p)
    if committed is not None:
        return _open_dir(committed)
    if parse_step_dir(p.name) is not None:
        raise CheckpointError(f"{p}: not a checkpoint directory (no {MANIFEST}: an unfinished save?)")
    raise CheckpointError(f"{p}: not a checkpoint directory (no {MANIFEST}) nor a checkpoint root "
                          f"(no {LATEST} file: nothing was committed here)")


def latest_step(root: str | os.PathLike) -> int | None:
    """The step ``latest`` names, or None when ``root`` holds no committed checkpoint.

    A ``latest`` that is garbled or names a missing checkpoint raises: silently starting a fresh
    run over a damaged one would lose it.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    committed = _committed(root)
    return None if committed is None else parse_step_dir(committed.name)
