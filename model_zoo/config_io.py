"""What GPT and BERT configs share: field type checks and reading a ``config.json``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def check_type(owner: str, name: str, value: Any, annotation: str) -> None:
    """Raise ValueError unless ``value`` fits the (string) field annotation of ``owner.name``."""
    optional = annotation.startswith("Optional[")
    base = annotation[len("Optional["):-1] if optional else annotation
    if optional and value is None:
        return
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[base]
    if not ok:
        want = f"{base} or null" if optional else base
        raise ValueError(f"{owner}.{name}={value!r} has type {type(value).__name__}; expected {want}")


def read_config_json(path: str | Path, what: str) -> dict:
    """The JSON object in ``path`` (or ``path/config.json``); one-line ValueError otherwise."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {what} config {path}: {e}") from None
