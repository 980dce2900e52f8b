"""A corpus's input files, read as a stream of documents (``mpt data prepare``): memory holds one
document (a text file) or one batch of rows (JSON lines, Parquet, Arrow), whatever the corpus size.

    sources = expand(["data/", "extra.jsonl.gz", "stdlib"])     # files in a fixed order
    for text, read in sources[0].documents("text"):             # read: bytes of the file read so far
        ...
    for k, j, text, read in Documents(sources, [0, 2], "text"):  # document j of file k
        ...

What each input is (`expand`):

- ``.txt`` / ``.py`` / ``.md``: the whole file is one document (an empty file is none);
- ``.jsonl`` / ``.json``: JSON lines, each an object whose ``key`` field (a string) is a document;
  blank lines are skipped; a line that is not JSON or lacks the field is a `DataError` naming file:line;
- any of those with ``.gz`` (gzip) or ``.zst`` (zstandard, when the package is installed) after it;
- ``.parquet``: the ``key`` column, row groups streamed (pyarrow, which ``datasets`` is built on);
- ``.arrow`` and a ``save_to_disk`` directory: ``datasets.Dataset.from_file`` / ``load_from_disk``,
  memory-mapped, read in batches of `ROWS_PER_BATCH` rows;
- another directory: searched recursively for the suffixes above and save_to_disk directories,
  sorted by relative path (hidden names passed over);
- ``stdlib``: this interpreter's standard library (`mp_toolkit.data.corpus.stdlib_files`).

Text must be strict UTF-8: anything else is a `DataError` naming the file and byte offset, except in
``stdlib``, where a non-UTF-8 file (a few are latin-1) is skipped rather than decoded with replacements; the
stream then yields ``None`` for it, so the caller can count it. An empty text is not a document.
Nothing is downloaded.
"""

from __future__ import annotations

import codecs
import gzip
import io
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet

from mp_toolkit.data.corpus import JSON_SUFFIXES, TEXT_SUFFIXES, stdlib_files
from mp_toolkit.errors import DataError
from mp_toolkit.user_files import link_note, parse_json, special_kind

COMPRESSIONS = (".gz", ".zst")
TABLE_SUFFIXES = (".parquet", ".arrow")
ROWS_PER_BATCH = 1024
STDLIB = "stdlib"


@dataclass(frozen=True)
class Source:
    """One input: a file (``kind`` text, jsonl, parquet or arrow, maybe compressed) or a
    ``save_to_disk`` directory (``kind`` saved)."""

    path: Path
    kind: str
    size: int
    """Bytes on disk (a saved directory: its files together)."""
    compression: str | None = None
    """None, ".gz" or ".zst"."""
    skip_non_utf8: bool = False
    """The ``stdlib`` input: a file that is not UTF-8 is skipped, not an error."""

    def documents(self, key: str) -> Iterator[tuple[str | None, int]]:
        """(document, bytes of this input read so far); ``None`` for a skipped non-UTF-8 file."""
        if self.kind in ("text", "jsonl"):
            yield from _stream_documents(self, key)
        elif self.kind == "parquet":
            yield from _parquet_documents(self, key)
        else:
            yield from _dataset_documents(self, key)


def expand(inputs: list[str | os.PathLike], exclude: Path | None = None) -> list[Source]:
    """The input files the user's paths name, in order (module docstring); ``exclude``: a directory
    never searched (the output, which holds JSON files of its own)."""
    sources: list[Source] = []
    for given in inputs:
        if str(given) == STDLIB:
            sources += [Source(p, "text", p.stat().st_size, skip_non_utf8=True) for p in stdlib_files()]
            continue
        path = Path(given)
        if not path.exists():
            raise DataError(f"input {path} does not exist (give files, directories or {STDLIB!r})")
        if path.is_dir() and not _is_saved_dataset(path):
            found = _search(path, exclude)
            if not found:
                raise DataError(f"input directory {path} has no corpus files ({', '.join(_suffixes())})")
            sources += [_source(p) for p in found]
        else:
            sources.append(_source(path))
    return sources


def _search(root: Path, exclude: Path | None) -> list[Path]:
    """Corpus files and save_to_disk directories below ``root``, sorted by their path relative to it;
    hidden names (.git, .cache) and ``exclude`` are passed over."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        keep = []
        for d in dirnames:
            sub = here / d
            if d.startswith(".") or (exclude is not None and sub.resolve() == exclude.resolve()):
                continue
            (found if _is_saved_dataset(sub) else keep).append(sub)  # a saved dataset is one input
        dirnames[:] = [d.name for d in keep]
        found += [here / f for f in filenames if not f.startswith(".") and _kind(here / f) is not None]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def _suffixes() -> list[str]:
    plain = [*TEXT_SUFFIXES, *JSON_SUFFIXES]
    return [*plain, *(s + c for s in plain for c in COMPRESSIONS), *TABLE_SUFFIXES]


def _kind(path: Path) -> tuple[str, str | None] | None:
    """(kind, compression) of a file by its suffixes, None when it is not a corpus file."""
    suffixes = path.suffixes[-2:]
    compression = suffixes[-1] if suffixes and suffixes[-1] in COMPRESSIONS else None
    suffix = (suffixes[0] if len(suffixes) == 2 else "") if compression else (suffixes[-1] if suffixes else "")
    if suffix in TEXT_SUFFIXES:
        return "text", compression
    if suffix in JSON_SUFFIXES:
        return "jsonl", compression
    if suffix in TABLE_SUFFIXES and not compression:
        return suffix[1:], None
    return None


def _source(path: Path) -> Source:
    if path.is_dir():  # a save_to_disk directory
        if (path / "dataset_dict.json").is_file():
            try:
                splits = parse_json((path / "dataset_dict.json").read_bytes())["splits"]
                named = f" ({', '.join(map(str, splits))})"
            except (OSError, ValueError, KeyError, TypeError):
                named = ""
            raise DataError(f"input {path} is a DatasetDict: give one split's directory{named}")
        return Source(path, "saved", sum(p.stat().st_size for p in path.iterdir() if p.is_file()))
    special = special_kind(path)  # before its name: a FIFO would be waited on, a device read forever
    if special is not None:
        raise DataError(f"input {path}{link_note(path)} is {special}: give a regular file")
    kind = _kind(path)
    if kind is None:
        raise DataError(f"input {path} has suffix {''.join(path.suffixes[-2:]) or '(none)'}: use one of "
                        f"{', '.join(_suffixes())}, or a save_to_disk directory")
    return Source(path, kind[0], path.stat().st_size, kind[1])


def _is_saved_dataset(path: Path) -> bool:
    """A ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` directory."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


class _Counted(io.RawIOBase):
    """A raw file that counts the bytes read from disk (the progress of a compressed stream too)."""

    def __init__(self, raw):
        self._raw, self.count = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._raw.readinto(buffer)
        self.count += n or 0
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _open(source: Source) -> tuple[io.BufferedIOBase, _Counted, tuple[type[Exception], ...]]:
    """(the decompressed stream, the raw file under it, what reading it raises for damaged data)."""
    try:
        counted = _Counted(open(source.path, "rb", buffering=0))
    except OSError as e:
        raise DataError(f"cannot read {source.path}: {e.strerror}") from None
    if source.compression == ".gz":
        return gzip.GzipFile(fileobj=counted, mode="rb"), counted, (OSError, EOFError)
    if source.compression == ".zst":
        try:
            import zstandard  # optional: only .zst inputs need it, and it is no dependency of ours
        except ImportError:
            counted.close()
            raise DataError(f"{source.path} is zstandard-compressed: `pip install zstandard` to read it") from None
        reader = zstandard.ZstdDecompressor().stream_reader(counted, read_across_frames=True)
        return io.BufferedReader(reader), counted, (OSError, zstandard.ZstdError)
    return io.BufferedReader(counted, 1 << 20), counted, (OSError,)


def _stream_documents(source: Source, key: str) -> Iterator[tuple[str | None, int]]:
    """Documents of a text or JSON-lines file, plain or compressed, read as a stream."""
    where = f" of its {source.compression} content" if source.compression else ""
    stream, counted, damaged = _open(source)
    try:
        with stream:
            if source.kind == "text":
                text = _decoded(stream, source, where)
                if text != "":  # None: a skipped file, still counted
                    yield text, counted.count
                return
            offset = 0  # of the current line in the (decompressed) stream
            for lineno in itertools.count(1):
                line = stream.readline(MAX_JSON_LINE + 1)
                if not line:
                    return
                if len(line) > MAX_JSON_LINE:
                    raise DataError(f"{source.path}:{lineno} is longer than {MAX_JSON_LINE >> 20} MiB{where}: one "
                                    "document per line, at most that long (split it)")
                size, line = len(line), _utf8_line(source.path, lineno, offset, line, where)  # the bytes go
                text = _json_document(source.path, lineno, line, key)
                offset += size
                if text:
                    yield text, counted.count
    except damaged as e:  # unreadable, or a damaged or truncated gzip / zstd stream
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise DataError(f"cannot read {source.path}: {reason}") from None


MAX_JSON_LINE = 128 << 20
"""A JSON-lines document is read and parsed whole, holding about twice its length: a line may be this long."""

TEXT_CHUNK = 16 << 20
"""A text file is decoded this many bytes at a time: one that is not UTF-8 is refused having held one chunk."""


def _decoded(stream, source: Source, where: str) -> str | None:
    """The whole text of a UTF-8 stream, decoded chunk by chunk; None for a file that is not UTF-8 where
    such files are skipped (``stdlib``), else a DataError naming the first bad byte."""
    decoder, parts, offset = codecs.getincrementaldecoder("utf-8")(), [], 0
    while True:
        chunk = stream.read(TEXT_CHUNK)
        pending = len(decoder.getstate()[0])  # the bytes of a character cut by the previous chunk
        try:
            parts.append(decoder.decode(chunk, final=not chunk))
        except UnicodeDecodeError as e:
            if source.skip_non_utf8:
                return None
            raise DataError(f"{source.path} is not UTF-8: byte {offset - pending + e.start}{where} is "
                            f"{e.object[e.start]:#04x}") from None
        if not chunk:
            return "".join(parts)
        offset += len(chunk)


def _utf8_line(path: Path, lineno: int, offset: int, line: bytes, where: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno} is not UTF-8: byte {offset + e.start}{where} is "
                        f"{line[e.start]:#04x}") from None


def _json_document(path: Path, lineno: int, text: str, key: str) -> str | None:
    """The ``key`` field of one JSON line (None for a blank line)."""
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno} is not a JSON line ({e.msg}; one JSON object per line)") from None
    except RecursionError:
        raise DataError(f"{path}:{lineno} is not a JSON line (nested too deeply; one JSON object per line)") from None
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise DataError(f"{path}:{lineno} has no string {key!r} field (choose the field with --json-keys)")
    return record[key]


def _column_texts(path: Path, first_row: int, column: list, key: str) -> Iterator[str]:
    for row, text in enumerate(column, start=first_row):
        if not isinstance(text, str):
            raise DataError(f"{path}: row {row} has no string {key!r} (it holds {type(text).__name__})")
        if text:
            yield text


def _parquet_documents(source: Source, key: str) -> Iterator[tuple[str, int]]:
    """The ``key`` column of a Parquet file, one batch of rows at a time (progress: rows read x size)."""
    try:
        table = pyarrow.parquet.ParquetFile(source.path)
    except (OSError, pyarrow.ArrowException) as e:
        raise DataError(f"cannot read {source.path} as Parquet: {str(e).splitlines()[0]}") from None
    with table:
        names = table.schema_arrow.names
        if key not in names:
            raise DataError(f"{source.path} has no column {key!r} (it has {', '.join(names)}): choose one with "
                            "--json-keys")
        rows, done = max(table.metadata.num_rows, 1), 0
        for batch in table.iter_batches(batch_size=ROWS_PER_BATCH, columns=[key]):
            column = batch.column(0).to_pylist()
            for text in _column_texts(source.path, done, column, key):
                yield text, source.size * done // rows
            done += len(column)


def _dataset_documents(source: Source, key: str) -> Iterator[tuple[str, int]]:
    """The ``key`` column of an Arrow file or ``save_to_disk`` directory (memory-mapped by datasets)."""
    try:
        ds = datasets.load_from_disk(str(source.path)) if source.kind == "saved" else \
            datasets.Dataset.from_file(str(source.path))
    except (OSError, ValueError, pyarrow.ArrowException) as e:
        raise DataError(f"cannot read {source.path} as a datasets {source.kind} dataset: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if key not in ds.column_names:
        raise DataError(f"{source.path} has no column {key!r} (it has {', '.join(ds.column_names)}): choose one "
                        "with --json-keys")
    rows, done = max(ds.num_rows, 1), 0
    for batch in ds.select_columns([key]).iter(batch_size=ROWS_PER_BATCH):
        column = batch[key]
        for text in _column_texts(source.path, done, column, key):
            yield text, source.size * done // rows
        done += len(column)


class Documents:
    """The documents of some of ``sources`` (by number k), in order, as (k, j, text, bytes of those
    files read so far), j counting file k's documents from 0; the skipped non-UTF-8 files are noted."""

    def __init__(self, sources: list[Source], files: list[int], key: str):
        self.sources, self.files, self.key = sources, files, key
        self.skipped_files: list[Path] = []
        self.total = sum(sources[k].size for k in files)

    def __iter__(self) -> Iterator[tuple[int, int, str, int]]:
        before = 0
        for k in self.files:
            j = 0
            for text, read in self.sources[k].documents(self.key):
                if text is None:
                    self.skipped_files.append(self.sources[k].path)
                    continue
                yield k, j, text, before + read
                j += 1
            before += self.sources[k].size
