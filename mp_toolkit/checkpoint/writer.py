"""Writing a checkpoint: `begin` -> every rank `write_shard` -> rank 0 `commit`.

The caller provides the barriers; nothing here communicates::

    tmp = begin(root, step, create=ctx.rank == 0)   # rank 0 clears scratch and makes the dir
    barrier()
    write_layer_shard(tmp, "h.3", {"h.3.attn.qkv.weight": full_qkv, ...})  # one writer per layer
    write_optimizer_shard(tmp, "h.3", optim_tensors, optim_scalars)
    write_rng_shard(tmp, ctx.rank, capture_rng())
    barrier()
    if ctx.rank == 0:
        commit(root, step, tmp, {"config": ..., "data": loader.state_dict(), ...}, keep=3)
    barrier()

Crash safety (DESIGN.md invariant 8). A checkpoint is *committed* when ``latest`` names it.
``commit`` hashes and lists every file, writes ``manifest.json``, renames the temp dir to
``step-XXXXXXXX`` and only then replaces ``latest``; every write is fsynced and replaced
atomically. A crash before the ``latest`` replace leaves ``latest`` on the previous complete
checkpoint, and what the crash left behind (``.tmp-*`` entries) is ignored by loaders and removed
by the next `begin`. Only one job may write to a root at a time.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from mp_toolkit.checkpoint.files import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MAX_MANIFEST,
    SHARD_SUFFIX,
    TMP_PREFIX,
    CheckpointError,
    atomic_write,
    check_name,
    check_relative,
    file_digest,
    from_json,
    fsync_dir,
    parse_step_dir,
    prepare_tensors,
    read_bounded,
    step_dir_name,
    to_json,
    write_text_atomic,
)


def layer_file(layer: str) -> str:
    return f"layers/{check_name(layer, 'layer name')}{SHARD_SUFFIX}"


def optimizer_file(layer: str) -> str:
    return f"optim/{check_name(layer, 'layer name')}{SHARD_SUFFIX}"


def rng_file(rank: int) -> str:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise CheckpointError(f"rank must be an integer >= 0, got {rank!r}")
    return f"rng/rank-{rank:05d}{SHARD_SUFFIX}"


def split_by_layer(named: Mapping[str, object], layer_names: Iterable[str]) -> dict[str, dict[str, object]]:
    """Group ``{parameter name: value}`` by layer: the layer whose name plus ``.`` prefixes it.

    The longest matching layer name wins, so ``h.1`` never claims ``h.10.mlp.weight``.
    """
    layers = sorted(layer_names, key=len, reverse=True)
    out: dict[str, dict[str, object]] = {}
    for name, value in named.items():
        layer = next((candidate for candidate in layers if name.startswith(candidate + ".")), None)
        if layer is None:
            raise CheckpointError(f"parameter {name!r} belongs to none of the layers {sorted(layers)[:8]}")
        out.setdefault(layer, {})[name] = value
    return out


def _tmp_path(root: Path, step: int) -> Path:
    return root / f"{TMP_PREFIX}{step_dir_name(step)}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def clear_scratch(root: str | os.PathLike) -> None:
    """Remove every ``.tmp-*`` entry of ``root``: what crashed or interrupted saves left behind.

    Only for the root's one writer (a training run holding its lock, `save_checkpoint`): another
    job's save in progress is scratch too."""
    root = Path(root)
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                _remove(entry)


def begin(root: str | os.PathLike, step: int, *, create: bool = True) -> Path:
    """The temporary directory ``root/.tmp-step-XXXXXXXX`` this step's shards are written into.

    With ``create`` (rank 0 only) a stale copy of this very directory is removed, nothing else of
    the root (`clear_scratch` removes the rest), and an empty directory is made; other ranks pass
    ``create=False`` to get the same path, and write only after the caller's barrier.
    """
    root = Path(root)
    tmp = _tmp_path(root, step)
    if not create:
        return tmp
    root.mkdir(parents=True, exist_ok=True)
    _remove(tmp)
    tmp.mkdir()
    try:
        fsync_dir(root)
    except OSError:
        discard(tmp)
        raise
    return tmp


def discard(tmp: str | os.PathLike) -> None:
    """Best effort: remove a failed save's temp directory (a failing disk may refuse that too;
    then it stays as scratch that readers ignore and the run's next start removes)."""
    try:
        _remove(Path(tmp))
    except OSError:
        pass


def write_shard(tmp: str | os.PathLike, relative_name: str, tensors: Mapping[str, torch.Tensor],
                metadata: Mapping[str, str] | None = None) -> Path:
    """Atomically write one safetensors file ``tmp/relative_name`` (fsynced, then os.replace'd).

    ``metadata`` (str -> str) goes into the safetensors header. Write each file from one rank.
    """
    tmp, rel = Path(tmp), check_relative(relative_name)
    if not tmp.is_dir():
        raise CheckpointError(f"{tmp} does not exist: rank 0 calls begin(root, step) and every rank "
                              "waits at a barrier before writing shards")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"shard {rel}: safetensors metadata must map strings to strings")
    path = tmp / rel
    if path.parent != tmp and not path.parent.is_dir():
        path.parent.mkdir(exist_ok=True)  # several ranks may race to make layers/ or optim/
        fsync_dir(tmp)
    prepared = prepare_tensors(tensors, f"shard {rel}")
    meta = dict(metadata) if metadata is not None else None
    atomic_write(path, lambda p: _save_file(prepared, p, meta))
    return path


def _save_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None) -> None:
    """`safetensors.torch.save_file`, its I/O failures raised as the OSError they are (safetensors
    reports ``ENOSPC`` as ``SafetensorError('... I/O error: No space left on device (os error 28)')``)."""
    try:
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    except safetensors.SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise CheckpointError(f"{path}: {' '.join(str(e).split())}") from None
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None


def write_layer_shard(tmp, layer: str, tensors: Mapping[str, torch.Tensor]) -> Path:
    """``layers/<layer>.safetensors``: FULL (TP-gathered) tensors under the unsplit model's names,
    each starting with ``<layer>.`` (``h.0.attn.qkv.weight`` for layer ``h.0``)."""
    _check_owned(layer, tensors)
    return write_shard(tmp, layer_file(layer), tensors)


def write_optimizer_shard(tmp, layer: str, tensors: Mapping[str, Mapping[str, torch.Tensor]],
                          scalars: Mapping[str, Mapping[str, object]] | None = None) -> Path:
    """``optim/<layer>.safetensors``: per-parameter optimizer state of one layer.

    ``tensors`` is ``{param name: {state key: tensor}}`` stored under ``"<param>.<key>"`` (so a
    state key may not contain ``.``); ``scalars`` (``{param: {key: JSON value}}``) go as JSON into
    the file's metadata, so every rank stores its own without gathering them to rank 0.
    """
    _check_owned(layer, {**tensors, **(scalars or {})})
    flat: dict[str, torch.Tensor] = {}
    for param, state in tensors.items():
        for key, value in state.items():
            if not isinstance(key, str) or not key or "." in key:
                raise CheckpointError(f"optimizer state key {key!r} of {param} must be a non-empty string without '.'")
            flat[f"{param}.{key}"] = value
    metadata = {"scalars": to_json(dict(scalars or {}), f"optimizer scalars of layer {layer}")}
    return write_shard(tmp, optimizer_file(layer), flat, metadata)


def write_rng_shard(tmp, rank: int, state) -> Path:
    """``rng/rank-XXXXX.safetensors``: one rank's `RngState` (generator tensors + JSON data)."""
    metadata = {"rank": str(rank), "rng": to_json(state.data, f"RNG state of rank {rank}")}
    return write_shard(tmp, rng_file(rank), state.tensors, metadata)


def _check_owned(layer: str, named: Mapping[str, object]) -> None:
    for name in named:
        if not isinstance(name, str) or not name.startswith(layer + "."):
            raise CheckpointError(f"parameter {name!r} does not belong to layer {layer!r} "
                                  f"(names are '{layer}.<path inside the layer>')")


def _listing(tmp: Path) -> dict[str, dict]:
    """``{relative path: {sha256, bytes}}`` of every shard under ``tmp``; scratch is refused."""
    files: dict[str, dict] = {}
    for dirpath, dirnames, filenames in os.walk(tmp):
        dirnames.sort()
        for fname in sorted(filenames):
            path = Path(dirpath) / fname
            rel = path.relative_to(tmp).as_posix()
            if rel == MANIFEST:
                continue  # an earlier failed commit's manifest: rewritten below
            if fname.startswith(TMP_PREFIX):
                raise CheckpointError(f"{tmp}: {rel} is an unfinished write: a rank failed while saving")
            check_relative(rel)
            if path.is_symlink() or not path.is_file():
                raise CheckpointError(f"{tmp}: {rel} is not a regular file")
            digest, size = file_digest(path)
            files[rel] = {"sha256": digest, "bytes": size}
    return files


def read_latest(root: Path, strict: bool = True) -> str | None:
    """The directory name ``latest`` holds, None without one (or, unless strict, a garbled one)."""
    path = root / LATEST
    if not os.path.lexists(path):
        return None
    try:
        text = read_bounded(path, 64, str(path)).decode("utf-8").strip()
    except (CheckpointError, UnicodeDecodeError) as e:
        if strict:
            raise CheckpointError(f"{path}: cannot be read ({e})" if isinstance(e, UnicodeDecodeError)
                                  else str(e)) from None
        return None
    if parse_step_dir(text) is None:
        if strict:
            raise CheckpointError(f"{path}: holds {text[:40]!r}, not a step-XXXXXXXX directory name")
        return None
    return text


def complete_checkpoints(root: Path) -> list[Path]:
    """``step-*`` directories holding a manifest, oldest step first."""
    found = [(parse_step_dir(d.name), d) for d in root.iterdir()
             if parse_step_dir(d.name) is not None and not d.is_symlink()]
    return [d for _, d in sorted(found) if (d / MANIFEST).is_file()]


def replaced_name(name: str) -> str:
    """Where `commit` keeps an existing ``step-N`` while a new save takes its name."""
    return f"{TMP_PREFIX}replaced-{name}"


def _set_aside(root: Path, final: Path) -> Path:
    """Rename an existing ``step-N`` out of the way so this save can take its name.

    When ``latest`` names ``step-N`` it first moves back to the highest older complete
    checkpoint, so a crash before the new ``step-N`` lands resumes from a complete one. With no
    older checkpoint ``latest`` is left as it is: in that short window it names a missing
    directory, which loaders refuse loudly (pointing at the set-aside copy) rather than letting a
    run start from scratch.
    """
    if read_latest(root, strict=False) == final.name:
        step = parse_step_dir(final.name)
        older = [d for d in complete_checkpoints(root) if parse_step_dir(d.name) < step]
        if older:
            write_text_atomic(root / LATEST, older[-1].name + "\n")
    aside = root / replaced_name(final.name)
    _remove(aside)
    os.rename(final, aside)
    fsync_dir(root)
    return aside


def run_of(checkpoint: Path) -> str | None:
    """The ``meta.run`` id a checkpoint's manifest records (None: none, or an unreadable manifest)."""
    try:
        doc = from_json(read_bounded(checkpoint / MANIFEST, MAX_MANIFEST, str(checkpoint), below=checkpoint))
    except (CheckpointError, ValueError, UnicodeDecodeError):
        return None
    meta = doc.get("meta") if isinstance(doc, dict) else None
    return meta.get("run") if isinstance(meta, dict) else None


def _prune(root: Path, keep: int | None, run: str | None) -> None:
    """Delete all but the ``keep`` highest-step complete checkpoints, never the one latest names.
    With ``run`` only checkpoints whose manifest names that run (``meta.run``) are counted and
    deleted: another run's checkpoints in the same root are not this one's to remove.

    Each is renamed to scratch before it is removed, so a crash mid-delete never leaves a
    ``step-*`` directory that looks complete but misses files.
    """
    if keep is None:
        return
    latest = read_latest(root, strict=False)
    mine = [d for d in complete_checkpoints(root) if run is None or run_of(d) == run]
    for d in mine[:-keep]:
        if d.name != latest:
            doomed = root / f"{TMP_PREFIX}delete-{d.name}"
            os.rename(d, doomed)
            fsync_dir(root)
            shutil.rmtree(doomed)


def commit(root: str | os.PathLike, step: int, tmp: str | os.PathLike, manifest: Mapping,
           keep: int | None = 3) -> Path:
    """Seal ``tmp`` as ``root/step-XXXXXXXX``, move ``latest`` to it, keep the ``keep`` newest.

    Rank 0 calls it after every rank wrote its shards. ``manifest`` is the caller's JSON-able
    data (config, data position, loss-scaler state, param-group hyper-parameters, ...); it is
    stored under ``"meta"`` next to the step, the format version and every file's SHA-256 and
    size (JSON: tuples read back as lists). Saving a step that already exists replaces it (e.g.
    after rewinding a run). ``keep=None`` keeps every checkpoint.
    """
    root, tmp = Path(root), Path(tmp)
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise CheckpointError(f"keep must be an integer >= 1 (or None to keep all), got {keep!r}")
    name = step_dir_name(step)
    if tmp != _tmp_path(root, step) or not tmp.is_dir():
        raise CheckpointError(f"{tmp} is not the temp dir begin({str(root)!r}, {step}) made")
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "meta": dict(manifest)}
    to_json(doc, "manifest")  # fail before hashing gigabytes
    final, before, renamed = root / name, read_latest(root, strict=False), False
    try:
        doc["files"] = _listing(tmp)
        write_text_atomic(tmp / MANIFEST, to_json(doc, "manifest"))
        if os.path.lexists(final):
            _set_aside(root, final)
        os.rename(tmp, final)
        renamed = True
        fsync_dir(root)
        # The commit point: until this replace, `latest` names the previous complete checkpoint.
        write_text_atomic(root / LATEST, name + "\n")
    except OSError:  # a failing disk (ENOSPC, EIO, read-only): back to the state before this save
        _undo_commit(root, tmp, final, before, renamed)
        raise
    aside = root / replaced_name(name)
    if os.path.lexists(aside):
        _remove(aside)
    try:
        _prune(root, keep, manifest.get("run"))
    except OSError:
        pass  # committed already; what a failed delete left is scratch (``.tmp-delete-*``)
    return final


def _undo_commit(root: Path, tmp: Path, final: Path, before: str | None, renamed: bool) -> None:
    """After a write failed inside `commit`: remove what this save made, put back the checkpoint it
    was replacing and ``latest`` as it was (``before``), in an order that keeps ``latest`` on a
    complete checkpoint after each step. Best effort: when the disk refuses a step the rest is left
    as it is, which is the state a crash at that point leaves (RELIABILITY.md)."""
    aside = root / replaced_name(final.name)
    try:
        if read_latest(root, strict=False) == final.name != before:  # the replace went through
            _restore_latest(root, before)  # first, while the new checkpoint is still complete
        if renamed and not os.path.lexists(tmp):
            os.rename(final, tmp)  # never committed (or no longer): scratch again
        discard(tmp)
        if aside.is_dir() and not os.path.lexists(final):
            os.rename(aside, final)
        if read_latest(root, strict=False) != before:
            _restore_latest(root, before)
        fsync_dir(root)
    except OSError:
        pass


def _restore_latest(root: Path, before: str | None) -> None:
    if before is None:
        (root / LATEST).unlink(missing_ok=True)
    else:
        write_text_atomic(root / LATEST, before + "\n")


def save_checkpoint(root, step: int, layers: Mapping[str, Mapping[str, torch.Tensor]],
                    optim_tensors: Mapping[str, Mapping[str, Mapping[str, torch.Tensor]]] | None = None,
                    manifest: Mapping | None = None, keep: int | None = 3, *,
                    optim_scalars: Mapping[str, Mapping[str, Mapping[str, object]]] | None = None,
                    rng=None) -> Path:
    """Single-process save by the root's only writer: `clear_scratch`, `begin`, every shard, `commit`.

    ``layers`` is ``{layer: {param name: full tensor}}``; ``optim_tensors`` / ``optim_scalars``
    are ``{layer: {param name: {state key: value}}}`` (see `split_by_layer`); ``rng`` an optional
    `RngState` stored as rank 0's.
    """
    clear_scratch(root)  # the root's one writer: what crashed saves left is scratch
    tmp = begin(root, step)
    try:
        for layer, tensors in layers.items():
            write_layer_shard(tmp, layer, tensors)
        optim_tensors, optim_scalars = optim_tensors or {}, optim_scalars or {}
        for layer in sorted(set(optim_tensors) | set(optim_scalars)):
            write_optimizer_shard(tmp, layer, optim_tensors.get(layer, {}), optim_scalars.get(layer))
        if rng is not None:
            write_rng_shard(tmp, 0, rng)
        return commit(root, step, tmp, manifest or {}, keep)
    except (OSError, CheckpointError):
        discard(tmp)  # a failed write leaves no partial directory; `latest` is unchanged
        raise
