"""DESIGN.md's layer table is true: every import of mp_toolkit/ and model_zoo/ (those inside functions
too) goes to its own floor, to floor 0, or to a floor its row's "may import" cell names, and every
floor a cell names is lower. Read statically (`ast`), nothing imported."""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mp_toolkit", "model_zoo")
HEADING = "## Layers of the code, and which may import which"
EVERY_FLOOR_BELOW = "every floor below"


@dataclass(frozen=True)
class Floor:
    number: int
    paths: tuple[str, ...]
    """Folders (``mp_toolkit/parallel/``) and modules (``mp_toolkit/layers.py``) on this floor."""
    may_import: tuple[str, ...]
    """Short names of the floors it may import (floor 0 aside), or (`EVERY_FLOOR_BELOW`,)."""


def short_name(path: str) -> str:
    """``mp_toolkit/parallel/`` -> ``parallel``, ``mp_toolkit/layers.py`` -> ``layers``."""
    return Path(path.rstrip("/")).name.removesuffix(".py")


def layer_table(text: str) -> list[Floor]:
    """The floors of the markdown table under `HEADING`, in the table's order (its first column numbers them)."""
    section = text[text.index(HEADING):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|") or set(line) <= set("|-"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not cells[0].isdigit():  # the header row
            continue
        may = cells[3]
        rows.append(Floor(int(cells[0]), tuple(re.findall(r"`([^`]+)`", cells[1])),
                          (EVERY_FLOOR_BELOW,) if EVERY_FLOOR_BELOW in may else tuple(re.findall(r"`([^`]+)`", may))))
    return rows


FLOORS = layer_table((ROOT / "DESIGN.md").read_text(encoding="utf-8"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def floor_of(path: Path) -> Floor:
    """The floor whose folder or module holds ``path`` (the most specific one)."""
    rel = path.relative_to(ROOT).as_posix()
    found = [(len(p), f) for f in FLOORS for p in f.paths if rel == p or (p.endswith("/") and rel.startswith(p))]
    assert found, f"{rel} is on no floor of DESIGN.md's layer table: add its folder or module to a row"
    return max(found, key=lambda x: x[0])[1]


def imported_modules(source: str, name: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, project module) of every import in module ``name``'s ``source``, in functions too,
    relative ones resolved; ``from pkg import x`` imports the module that defines ``x``."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: None if is_package else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for full in names:
            while full and full not in MODULES:  # `from pkg import name`: the module that defines it
                full = full.rpartition(".")[0]
            if full and full != name:
                out.add((node.lineno, full))
    return sorted(out)


def permits(here: Floor, there: Floor) -> bool:
    """Whether a module on ``here`` may import one on ``there``: its own floor, floor 0, or one its cell names."""
    if there.number in (0, here.number):
        return True
    if here.may_import == (EVERY_FLOOR_BELOW,):
        return there.number < here.number
    return any(short_name(p) in here.may_import for p in there.paths)


def arrows() -> tuple[list[str], list[str]]:
    """(imports the table does not allow, those of them that go to a higher floor), as ``file:line a -> b``."""
    refused, upward = [], []
    for name, path in MODULES.items():
        here = floor_of(path)
        source = path.read_text(encoding="utf-8")
        for line, target in imported_modules(source, name, path.name == "__init__.py"):
            there = floor_of(MODULES[target])
            if not permits(here, there):
                what = (f"{path.relative_to(ROOT)}:{line} {name} (floor {here.number}) -> "
                        f"{target} (floor {there.number})")
                refused.append(what)
                if there.number > here.number:
                    upward.append(what)
    return refused, upward


def test_the_table_reads_as_floors_numbered_from_zero():
    assert [f.number for f in FLOORS] == list(range(len(FLOORS))) and len(FLOORS) > 10
    paths = [p for f in FLOORS for p in f.paths]
    assert len(paths) == len(set(paths))
    for p in paths:
        assert (ROOT / p).exists(), f"DESIGN.md's layer table names {p}, which does not exist"


def test_a_floor_may_import_only_lower_floors():
    by_name = {short_name(p): f for f in FLOORS for p in f.paths}
    for floor in FLOORS:
        for name in floor.may_import:
            if name == EVERY_FLOOR_BELOW:
                continue
            assert name in by_name, f"floor {floor.number} may import {name!r}, which names no row of the table"
            assert by_name[name].number < floor.number, f"floor {floor.number} may import {name} on floor " \
                                                        f"{by_name[name].number}: a floor imports lower floors only"


def test_every_module_is_on_one_floor():
    for path in MODULES.values():
        floor_of(path)


def test_no_import_goes_where_the_table_does_not_allow():
    refused, upward = arrows()
    assert not refused, f"{len(refused)} import(s) DESIGN.md's layer table does not allow ({len(upward)} of them " \
                        "to a higher floor):\n" + "\n".join(refused)


@pytest.mark.parametrize("source, expected", [
    ("from mp_toolkit.run.config import TrainConfig\n", "mp_toolkit.run.config"),
    ("def f():\n    from mp_toolkit.run import hf_family\n", "mp_toolkit.run.hf_family"),
    ("import mp_toolkit.parallel.context as c\n", "mp_toolkit.parallel.context"),
    ("from .measure import measure_layers\n", "mp_toolkit.partition.measure"),
    ("from ..run.cut import plan_boundaries\n", "mp_toolkit.run.cut"),
    ("from model_zoo import gpt\n", "model_zoo.gpt"),
])
def test_the_reader_finds_each_form_of_import(source, expected):
    """The checker itself: a module of partition/ importing in each form is seen to import ``expected``."""
    assert imported_modules(source, "mp_toolkit.partition.solvers") == [(source.count("\n"), expected)]
    assert imported_modules("import torch\nfrom collections import abc\n", "mp_toolkit.partition.solvers") == []


def test_the_table_refuses_an_arrow_up_and_sideways():
    """partition/ may import arch/ and engine/ below it, not run/ above it nor hf/ beside it; run/ may
    import every floor below; every floor may import floor 0."""
    floor = {short_name(p): f for f in FLOORS for p in f.paths}
    assert permits(floor["partition"], floor["arch"]) and permits(floor["partition"], floor["engine"])
    assert not permits(floor["partition"], floor["run"]) and not permits(floor["partition"], floor["hf"])
    assert permits(floor["run"], floor["partition"]) and not permits(floor["run"], floor["ds"])
    assert permits(floor["model_zoo"], floor["errors"]) and not permits(floor["model_zoo"], floor["layers"])
