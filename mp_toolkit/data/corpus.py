"""The corpus found on every machine (this interpreter's standard library, `stdlib_files`) and the file
suffixes read as text: ``.txt``/``.py``/``.md`` files are one document each, ``.jsonl``/``.json`` files JSON
lines (`mp_toolkit.data.sources` reads them, with the compressed and columnar formats).
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

__all__ = ["JSON_SUFFIXES", "TEXT_SUFFIXES", "stdlib_files"]

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
