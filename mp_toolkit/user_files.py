"""What a path the user names is, and JSON read without trusting its depth: the words every reader of
user files shares (``--hf`` directories, corpora, configs, outputs).

Policy on links and special files: a symbolic link the user names, or one inside a directory the user
names, is followed (HuggingFace's hub cache is made of links into its ``blobs/``), and every message
about the file names the link's target (`link_note`); what it reaches must be a regular file
(directories where a directory is asked for). A FIFO, a socket or a device is refused by its kind
(`special_kind`) before it is opened, so nothing waits on a FIFO. Checkpoints are stricter and refuse
links altogether (`mp_toolkit.checkpoint.files`), and a directory a command replaces (``mpt export --out``)
is refused when it is a link.
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mp_toolkit.errors import ConfigError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def special_kind(path: str | os.PathLike) -> str | None:
    """"a FIFO", "a directory", "a socket", "a character device" or "a block device" where ``path``
    (its links followed) is not a regular file; None for a regular file or nothing there (a name no
    file can have, with a NUL byte in it, included: what then opens it says it is not there)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return next((word for test, word in _KINDS if test(mode)), None)


def link_note(path: str | os.PathLike) -> str:
    """`` (a link to TARGET)`` when ``path`` is a symbolic link (TARGET fully resolved), else ``""``."""
    path = Path(path)
    return f" (a link to {path.resolve()})" if path.is_symlink() else ""


def parse_json(text: str | bytes, **options) -> Any:
    """``json.loads(text, **options)``; a document nested too deeply for Python's parser is a ValueError like
    any other malformed JSON (json.JSONDecodeError is one too), never a RecursionError."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def cannot_write(what: str, path: str | os.PathLike, e: OSError) -> ConfigError:
    """The one line for an output ``what`` (a flag: ``--metrics``) that ``path`` cannot take."""
    return ConfigError(f"{what} {path}: cannot write it ({e.strerror or e}): choose a path you can write, on a "
                       "device with room")


@contextmanager
def writing(what: str, path: str | os.PathLike):
    """Inside, an OSError (a full device, a read-only or missing place, a permission) is `cannot_write`'s
    ConfigError: every output a command writes ends in one line, never a traceback. A name with a NUL
    byte, which no system call takes, is refused on entry."""
    if "\x00" in os.fspath(path):
        raise ConfigError(f"{what} {os.fspath(path)!r}: a file name cannot hold a NUL byte")
    try:
        yield
    except OSError as e:
        raise cannot_write(what, path, e) from None


def write_output(what: str, path: str | os.PathLike, data: str | bytes) -> None:
    """A whole output file (``--json``, ``--profile-here``, a chart's PNG or SVG): a regular file, or a
    new one in a folder made for it, is replaced atomically (a temporary file beside it, then renamed over
    it); a FIFO or a device (``/dev/stdout``) is written in place, never replaced, and a FIFO without a
    reader is refused rather than waited on; a directory is refused. Every failure is one ConfigError line
    (`writing`)."""
    p, raw = Path(path), data.encode("utf-8") if isinstance(data, str) else data
    kind = special_kind(p)
    if kind == "a directory":
        raise ConfigError(f"{what} {p} is a directory: give a file path")
    with writing(what, p):
        if kind is not None:
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            os.set_blocking(fd, True)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            return
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.replace(tmp, p)
        except BaseException:
            os.unlink(tmp)
            raise


def check_output_file(what: str, path: str | os.PathLike) -> None:
    """Before a run starts: ``path`` can be opened for appending (it is created empty if absent; a FIFO or
    device is left alone) and is not a directory; one ConfigError line otherwise."""
    kind = special_kind(path)
    if kind == "a directory":
        raise ConfigError(f"{what} {path} is a directory: give a file path")
    if kind is None:
        with writing(what, path):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            open(path, "a").close()


MAX_CONFIG_BYTES = 64 << 20
"""A config file (DeepSpeed, cluster, HF config.json) larger than this is not one."""


def read_config_text(path: str | os.PathLike, what: str, limit: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of a small file the user names (``what``: ``--config``); one ConfigError line for
    nothing there, a FIFO, device or directory (opened without blocking and refused by its kind, so nothing
    waits on a FIFO or reads an endless device), more than ``limit`` bytes, or bytes that are not UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{what} {path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"{what} {path}{link_note(path)} is {special_kind(path) or 'not a regular file'}, not a file")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise ConfigError(f"{what} {path}: {st.st_size} bytes is more than a config holds (at most {limit})")
        try:
            return f.read(limit + 1).decode("utf-8")
        except OSError as e:
            raise ConfigError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{what} {path}: not UTF-8 text (byte {e.start})") from None
