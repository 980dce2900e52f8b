"""Reading a corpus: files and directories -> documents (one string each), without touching the network.

Corpora are local files (by default this interpreter's standard library, `stdlib_files`):
``.txt``/``.py``/``.md`` files are one document each, ``.jsonl``/``.json`` files are JSON lines whose
"text" fields are documents (`read_texts`). ``DataError`` (`mp_toolkit.errors`) is what the data modules raise
for a value the user can fix.
"""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Iterable

from mp_toolkit.errors import DataError

__all__ = ["DataError", "read_texts", "stdlib_files"]

TEXT_SUFFIXES = (".txt", ".py", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
STDLIB_MAX_BYTES = 12 * 1024 * 1024
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib"}


def stdlib_files() -> list[Path]:
    """This interpreter's standard-library ``.py`` files, sorted, capped at ~12 MB in total.

    Test suites, idlelib and installed packages are skipped to bound the size; the order (and so
    the cut at 12 MB) is deterministic for a given interpreter.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).parts
        # Prune while walking: site-packages alone can be larger than the whole stdlib.
        dirnames[:] = [
            d for d in dirnames
            if d not in _STDLIB_SKIP_DIRS and not (rel == ("lib2to3",) and d == "tests")
        ]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    files, total = [], 0
    for path in sorted(found, key=lambda p: p.relative_to(root).parts):
        size = path.stat().st_size
        if total + size > STDLIB_MAX_BYTES:
            break
        files.append(path)
        total += size
    return files


def _expand(path: Path) -> list[Path]:
    """A user path -> the corpus files it names (a directory is searched recursively)."""
    if path.is_dir():
        found = sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSON_SUFFIXES
        )
        if not found:
            raise DataError(
                f"corpus directory {path} has no {'/'.join(TEXT_SUFFIXES + JSON_SUFFIXES)} files"
            )
        return found
    if not path.is_file():
        raise DataError(f"corpus path {path} does not exist or is not a file or directory")
    if path.suffix not in TEXT_SUFFIXES + JSON_SUFFIXES:
        raise DataError(
            f"corpus file {path} has suffix {path.suffix!r}: use one of "
            f"{', '.join(TEXT_SUFFIXES + JSON_SUFFIXES)}"
        )
    return [path]


def _json_texts(path: Path, content: str) -> list[str]:
    """The "text" field of every JSON line (blank lines are skipped)."""
    texts = []
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno} is not a JSON line ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{lineno} has no string "text" field')
        texts.append(record["text"])
    return texts


def read_texts(paths: Iterable[str | os.PathLike]) -> tuple[list[str], list[Path]]:
    """Read documents from files or directories; returns (texts, files skipped as non-UTF-8).

    ``.txt``/``.py``/``.md`` files are one document each; ``.jsonl``/``.json`` files are JSON
    lines whose "text" fields are documents. Files that do not decode as strict UTF-8 are skipped
    deliberately (a few stdlib files are latin-1) rather than decoded with replacement characters.
    """
    texts: list[str] = []
    skipped: list[Path] = []
    for given in paths:
        for path in _expand(Path(given)):
            try:
                raw = path.read_bytes()
            except OSError as e:
                raise DataError(f"cannot read corpus file {path}: {e.strerror}") from None
            try:
                content = raw.decode("utf-8")
            except UnicodeDecodeError:
                skipped.append(path)
                continue
            if path.suffix in JSON_SUFFIXES:
                texts.extend(_json_texts(path, content))
            elif content:
                texts.append(content)
    return texts, skipped
