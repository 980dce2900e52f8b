"""On-disk primitives of a checkpoint: names, hashes, atomic writes, verified safetensors reads.

Nothing here unpickles. A shard (a safetensors file: a JSON header followed by raw tensor bytes) is
read only after its size matched the manifest and its header passed `_check_header`; each tensor's
bytes are then read straight into the tensor and hashed as they arrive, and the tensors are returned
only when the SHA-256 matches the manifest's (read once, so a file swapped between the check and the
load cannot slip through; the peak is the shard's tensors, no copy of the file beside them). A hostile
file can at worst be refused with a `CheckpointError`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from mp_toolkit.errors import CheckpointError
from mp_toolkit.user_files import parse_json

FORMAT = "mp_toolkit.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
"""Every entry of a checkpoint root whose name starts with this is scratch: an unfinished save, a
checkpoint being replaced or deleted, a half-written ``latest``. Loaders never look at them and
`begin` removes them."""
SHARD_SUFFIX = ".safetensors"
MAX_NAME = 200
_STEP_RE = re.compile(r"step-(\d{8,})")
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
MAX_HEADER = 100 << 20    # the limit safetensors itself puts on a header
MAX_MANIFEST = 64 << 20   # a manifest is config and counters: anything larger is not ours
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
             "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def step_dir_name(step: int) -> str:
    """``step-00000012``: eight digits so names sort by step (more digits past 10^8 still parse)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint step must be an integer >= 0, got {step!r}")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-XXXXXXXX`` name, or None for any other name."""
    match = _STEP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def check_name(name: str, what: str = "name") -> str:
    """``name`` unchanged when it is safe as one file-name component, else CheckpointError.

    Layer names are used as file names as they are (``h.0``, ``embed``, ``encoder.layer.3``), not
    escaped, so a file name always reads back as its layer name. Path separators, ``..``, a
    leading ``.`` (hidden and scratch files) and characters shells or other systems mangle are
    refused.
    """
    if (not isinstance(name, str) or len(name) > MAX_NAME or not _NAME_RE.fullmatch(name)
            or ".." in name):
        raise CheckpointError(
            f"{what} {name!r} cannot be a checkpoint file name: use letters, digits, '_', '-' and "
            f"'.', not '..' and not a leading '.', at most {MAX_NAME} characters")
    return name


def check_relative(rel: str) -> str:
    """A shard's path inside a checkpoint (``layers/h.0.safetensors``), checked component-wise.

    Manifests are untrusted input: this is what keeps a listed ``../../x`` or ``/etc/x`` from
    being opened.
    """
    parts = rel.split("/") if isinstance(rel, str) else [rel]
    for part in parts:
        check_name(part, "shard path component")
    if not rel.endswith(SHARD_SUFFIX) or len(parts) > 2:
        raise CheckpointError(f"shard path {rel!r} must be '<name>{SHARD_SUFFIX}' or "
                              f"'<folder>/<name>{SHARD_SUFFIX}'")
    return rel


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable; Windows has no directory fsync."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(temp)`` a sibling temp file, fsync it, then ``os.replace`` it onto ``path``.

    Readers see the old file or the complete new one, never a prefix. The temp name starts with
    TMP_PREFIX, so a crash leaves only scratch that `begin` (or a failed commit) recognises.
    """
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def to_json(doc, what: str) -> str:
    """Strict JSON (no NaN / Infinity, which other readers reject) or a CheckpointError."""
    try:
        return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not JSON-able: {e}") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def from_json(data: bytes | str):
    """Strict JSON parse: NaN / Infinity, duplicate keys and nesting deeper than Python's stack are
    refused (ValueError)."""
    return parse_json(data, parse_constant=_refuse_constant, object_pairs_hook=_no_duplicates)


def open_regular(path: Path, what: str, below: Path | None = None):
    """A binary file object of the regular file ``path``, opened without following a link.

    A checkpoint is untrusted input: a symbolic link (as the file, or as a folder between ``below``
    and the file), a fifo, a device or a socket is refused with a CheckpointError. Opening never
    blocks (a fifo with no writer would hang a plain ``open``).
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        if below is not None and os.open in os.supports_dir_fd:
            fd = _open_beneath(below, path.relative_to(below).parts, flags)
        else:
            fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointError(f"{what}: missing") from None
    except OSError as e:
        linked = e.errno in (errno.ELOOP, errno.ENOTDIR) or os.path.islink(path)
        reason = "a symbolic link (refused)" if linked else f"cannot be read ({e.strerror})"
        raise CheckpointError(f"{what}: {reason}") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise CheckpointError(f"{what}: not a regular file (a fifo, device or folder is refused)")
    return f


def _open_beneath(base: Path, parts: tuple[str, ...], flags: int) -> int:
    """Open ``base/parts...`` refusing a symbolic link at every component below ``base``."""
    dir_flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(base, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in parts[:-1]:
            inner = os.open(part, dir_flags, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        os.close(fd)


def file_digest(path: Path, below: Path | None = None) -> tuple[str, int]:
    """(SHA-256 hex digest, size in bytes) of a regular file, streamed in 1 MiB blocks."""
    h, n = hashlib.sha256(), 0
    with open_regular(path, str(path), below) as f:
        while block := f.read(1 << 20):
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


def read_bounded(path: Path, limit: int, what: str, below: Path | None = None) -> bytes:
    """At most ``limit + 1`` bytes of a regular file (links, devices and fifos are refused), so a
    caller can tell "exactly limit" from "longer" without reading an unbounded file."""
    with open_regular(path, what, below) as f:
        size = os.fstat(f.fileno()).st_size
        return f.read(min(limit, size) + 1)


def read_shard(path: Path, record: Mapping, what: str, below: Path | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors on CPU, ``__metadata__``) of a manifest-listed shard, its size, header and SHA-256 checked.

    Nothing beyond the header is read until the file's size equals the manifest's ``bytes``, the header
    parses (`parse_header`) with its tensors tiling the rest of the file exactly, and the file fits in this
    machine's memory: an absurd ``bytes`` in a crafted manifest, or a sparse file as large as it says,
    allocates nothing. Then each tensor is allocated and its bytes read straight into it, the hash taken over
    the header and every tensor's bytes as they arrive (a stream: no copy of the file beside the tensors),
    and nothing is returned unless the hash matches: the bytes hashed are the bytes loaded."""
    size = record["bytes"]
    with open_regular(path, what, below) as f:
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            raise CheckpointError(f"{what}: {actual} bytes, {MANIFEST} says {size} (file truncated or modified)")
        head = f.read(8)
        head += f.read(min(int.from_bytes(head, "little"), MAX_HEADER)) if len(head) == 8 else b""
        metadata, entries, end = _check_header(head, size, what)
        if end != size:
            raise CheckpointError(f"{what}: its safetensors header accounts for {end} bytes but the file has {size} "
                                  "(file modified)")
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if size > memory:
            raise CheckpointError(f"{what}: {size} bytes is more than this machine's memory ({memory} bytes): "
                                  "it cannot be loaded here")
        digest = hashlib.sha256(head)
        tensors = {}
        for name, dtype, begin, stop, shape in entries:  # in file order, tiling the data
            t = torch.empty(shape, dtype=_DTYPES[dtype])
            view = memoryview(t.view(-1).view(torch.uint8).numpy()) if stop > begin else memoryview(b"")
            got = 0
            while got < len(view):
                n = f.readinto(view[got:got + _READ_BLOCK])
                if not n:
                    raise CheckpointError(f"{what}: {MANIFEST} says {size} bytes but the file ended early (file "
                                          "truncated or modified)")
                digest.update(view[got:got + n])
                got += n
            tensors[name] = t
    if digest.hexdigest() != record["sha256"]:
        raise CheckpointError(f"{what}: SHA-256 mismatch (file modified or truncated)")
    return tensors, metadata


_READ_BLOCK = 16 << 20

_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
           "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
           "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
           "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64}


def parse_header(head: bytes, size: int) -> tuple[int, dict[str, dict], dict[str, str]]:
    """(header length n, ``{name: {dtype, shape, data_offsets}}``, ``__metadata__``) of a safetensors file
    of ``size`` bytes whose first bytes are ``head`` (its 8-byte little-endian length and at least n bytes of
    JSON); ValueError saying what is wrong. Each entry is checked: a known dtype, a shape of non-negative
    integers and ``[begin, end)`` offsets that hold exactly that shape; where the data ends against the
    file is the caller's to judge."""
    if len(head) < 8:
        raise ValueError(f"{size} bytes is shorter than a safetensors header")
    n = int.from_bytes(head[:8], "little")
    if n > min(size - 8, MAX_HEADER) or len(head) < 8 + n:
        raise ValueError(f"its first 8 bytes give a header length ({n}) the file ({size} bytes) cannot hold")
    try:
        header = from_json(head[8:8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("its __metadata__ must map strings to strings")
    for name, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") not in _ITEMSIZE:
            raise ValueError(f"tensor {name!r} has no supported dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or not all(_count(d) for d in shape) or not isinstance(offsets, list)
                or len(offsets) != 2 or not all(_count(o) for o in offsets) or offsets[0] > offsets[1]
                or offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[info["dtype"]]):
            raise ValueError(f"tensor {name!r} has an invalid shape or byte range")
    return n, header, metadata


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_header(data: bytes, size: int, what: str) -> tuple[dict[str, str], list[tuple], int]:
    """(``__metadata__``, ``(name, dtype, begin, end, shape)`` of every tensor in file order, the byte where the
    last tensor's data ends) of a shard's safetensors header, checked (`parse_header`) with the tensors
    tiling the data from its first byte without a gap or an overlap, inside the file; CheckpointError
    otherwise."""
    try:
        n, header, metadata = parse_header(data, size)
    except ValueError as e:
        raise CheckpointError(f"{what}: safetensors: {e}") from None
    entries = sorted(((name, info["dtype"], *info["data_offsets"], tuple(info["shape"]))
                      for name, info in header.items()), key=lambda e: (e[2], e[3]))
    at = 0
    for name, _, begin, stop, _ in entries:
        if begin != at:
            raise CheckpointError(f"{what}: not a valid safetensors file (tensor {name!r} "
                                  f"{'overlaps another' if begin < at else 'leaves a gap before it'})")
        at = stop
    if 8 + n + at > size:
        raise CheckpointError(f"{what}: a tensor's byte range lies outside the file")
    return metadata, entries, 8 + n + at


def prepare_tensors(tensors: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that each own their storage, as `safetensors.save_file` requires.

    safetensors refuses tensors that share memory (a view, or one weight under two names); those
    are cloned so the file holds each tensor's bytes exactly once per name.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointError(f"{what}: tensor name {name!r} must be a non-empty string other than __metadata__")
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{what}: {name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if t.numel() and (storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size()):
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out
