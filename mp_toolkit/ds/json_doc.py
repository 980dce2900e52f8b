"""Reading a DeepSpeed JSON config: the file, and typed getters whose errors name the dotted key.

`mp_toolkit.ds.config` maps what these read onto our settings; this module knows only JSON.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mp_toolkit.run.config import ConfigError
from mp_toolkit.user_files import read_config_text


def show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, bool, int, float, type(None))) else repr(value)
    if value == "auto":
        text += " (a HuggingFace Trainer placeholder: write the value itself)"
    return text if len(text) < 80 else text[:77] + "..."


class Block:
    """One JSON object at a dotted path: typed getters whose errors name the key and the file, and a
    record of the keys they read."""

    def __init__(self, where: str, path: str, data: Any):
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: {path or 'the config'} must be a JSON object, got {show(data)}")
        self.where, self.path, self.data, self.used = where, path, data, set()

    def key(self, k: str) -> str:
        return f"{self.path}.{k}" if self.path else k

    def fail(self, k: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {self.key(k)} {message}")

    def get(self, k: str, default: Any = None) -> Any:
        """The value at ``k``; absent and JSON null both give ``default``."""
        self.used.add(k)
        v = self.data.get(k)
        return default if v is None else v

    def _typed(self, k: str, default: Any, ok, need: str) -> Any:
        v = self.get(k, default)
        if v is not None and not ok(v):
            raise self.fail(k, f"{show(v)} must be {need}")
        return v

    def integer(self, k: str, default: int | None, lowest: int = 1) -> int | None:
        need = "a positive integer" if lowest == 1 else f"an integer >= {lowest}"
        return self._typed(k, default, lambda v: type(v) is int and v >= lowest, need)

    def number(self, k: str, default: float | None, positive: bool = False) -> float | None:
        ok = lambda v: type(v) in (int, float) and math.isfinite(v) and (v > 0 if positive else v >= 0)  # noqa: E731
        v = self._typed(k, default, ok, f"a {'positive' if positive else 'non-negative'} finite number")
        return None if v is None else float(v)

    def boolean(self, k: str, default: bool) -> bool:
        return self._typed(k, default, lambda v: isinstance(v, bool), "true or false")

    def string(self, k: str, default: str | None = None) -> str | None:
        return self._typed(k, default, lambda v: isinstance(v, str), "a string")

    def block(self, k: str) -> Block | None:
        v = self.get(k)
        return None if v is None else Block(self.where, self.key(k), v)

    def only(self, k: str, allowed: bool, why: str) -> None:
        """A boolean option of which mp_toolkit implements one value."""
        if k in self.data and self.boolean(k, allowed) != allowed:
            raise self.fail(k, f"{json.dumps(not allowed)} is not supported: {why}")

    def finish(self, ignored: list[str], known: tuple[str, ...] | frozenset = (), strict: str | None = None) -> None:
        """Record the keys not read: ``known`` ones as ignored; others fail when ``strict`` names the
        accepted keys, else are ignored as unknown."""
        for k in self.data:
            if k in self.used:
                continue
            if k in known:
                ignored.append(self.key(k))
            elif strict is not None:
                raise self.fail(k, f"is not a known key here (DeepSpeed rejects it too): use {strict}")
            else:
                ignored.append(f"{self.key(k)} (unknown)")


def load_json(source: str | Path | dict) -> tuple[str, Any]:
    if isinstance(source, dict):
        return "DeepSpeed config (dict)", source
    if not isinstance(source, (str, Path)):
        raise ConfigError(f"a DeepSpeed config is a file path or a dict, got {type(source).__name__}")
    where = str(source)
    if not Path(source).exists() and not Path(source).is_symlink():
        raise ConfigError(f"{where}: no such DeepSpeed config file")
    text = read_config_text(source, "the DeepSpeed config")
    if not text.strip():
        raise ConfigError(f"{where}: the DeepSpeed config is empty: write a JSON object such as "
                          '{"train_batch_size": 32}')

    def no_duplicates(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise ConfigError(f"{where}: key {k!r} appears twice in one object (DeepSpeed rejects that too)")
            seen[k] = v
        return seen

    try:
        return where, json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid JSON (nested too deeply)") from None
