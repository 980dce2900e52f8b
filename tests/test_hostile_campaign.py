"""Issue 40: the hostile-input campaign. Every input kind a user can hand `mpt` -- HF directories,
checkpoints, DeepSpeed and cluster configs, corpora, caches, outputs, CLI values, links and special
files -- crafted as an attacker would, each case one `mpt ...` run in this process that must end in
one ``mpt <command>: error:`` line and a non-zero exit (a damaged cache: rebuilt, exit 0), within a
bounded time, with nothing written outside the paths the case names.

Each case is ``(class, id, build)``: ``build(ws)`` makes the input under ``ws.inputs`` and returns
the argv; outputs go under ``ws.outputs``. `CASES` is grouped by the issue's ten classes;
`test_the_campaign_counts_by_class` prints (and RELIABILITY.md gives) how many each holds. The
memory of refusing a large unusable corpus is measured in its own processes
(`test_refusing_a_large_unusable_corpus_holds_at_most_its_size`).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_toolkit.arch.hf_config import DROPOUT_KEYS, EPSILON_KEYS, SIZE_KEYS, shape_from_hf_config
from mp_toolkit.checkpoint.files import parse_header
from mp_toolkit.cli import main
from mp_toolkit.data.sources import MAX_JSON_LINE
from mp_toolkit.hf.configs import load_config
from tests.checkpoint_helpers import reseal
from tests.hf_workers import tiny_hf

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60
"""Each in-process case's bound (pytest-timeout): a hang fails its case instead of the suite."""


@dataclass
class Workspace:
    root: Path
    hf: dict[str, Path]
    checkpoint: Path

    @property
    def inputs(self) -> Path:
        return self.root / "in"

    @property
    def outputs(self) -> Path:
        return self.root / "out"

    def hf_copy(self, name: str = "gpt2", config: dict | None = None, weights: bytes | None = None) -> Path:
        """A copy of the tiny HF directory ``name`` under inputs, its config.json updated by ``config``
        and its model.safetensors replaced by ``weights``."""
        d = self.inputs / f"hf-{name}"
        d.mkdir()
        for f in self.hf[name].iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        if config:
            doc = json.loads((d / "config.json").read_text())
            doc.update(config)
            (d / "config.json").write_text(json.dumps(doc))
        if weights is not None:
            (d / "model.safetensors").write_bytes(weights)
        return d

    def prepared_copy(self, damage=None) -> Path:
        """A copy of the prepared corpus (`mpt data prepare`) under inputs, ``damage(dir)`` applied."""
        dst = self.inputs / "prepared"
        for src in sorted(self.hf["prepared"].rglob("*")):
            target = dst / src.relative_to(self.hf["prepared"])
            target.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                target.mkdir(exist_ok=True)
            else:
                target.write_bytes(src.read_bytes())
        if damage is not None:
            damage(dst)
        return dst

    def checkpoint_copy(self) -> Path:
        """A copy of the saved run (its root) under inputs; returns its step directory."""
        dst = self.inputs / "run"
        for src in self.checkpoint.rglob("*"):
            target = dst / src.relative_to(self.checkpoint)
            if src.is_symlink():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(os.readlink(src))
            elif src.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(src.read_bytes())
        return next(dst.glob("step-*"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The valid inputs the cases damage: tiny gpt2 / llama / bert HF directories and a saved gpt-tiny run."""
    base = tmp_path_factory.mktemp("campaign-sources")
    hf = {}
    for name, kind in (("gpt2", "gpt2"), ("llama", "llama"), ("bert", "bert-pretraining")):
        hf[name] = base / name
        tiny_hf(kind, seed=1).save_pretrained(hf[name])
    code = main(["train", "--model", "gpt-tiny", "--pp", "1", "--steps", "1", "--seq-len", "16", "--data",
                 "synthetic", "--no-progress", "--save-dir", str(base / "run")])
    assert code == 0
    corpus = base / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of the corpus, word{i % 37}" for i in range(400)))
    assert main(["data", "prepare", "--input", str(corpus), "--output", str(base / "prepared"), "--vocab-size", "300",
                 "--workers", "1", "--no-progress"]) == 0
    hf["prepared"] = base / "prepared"
    return hf, base / "run"


def _tree(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its kind, and for a file its size and mtime (links not followed; a
    folder's own mtime changes with a lock file made and removed in it, and is left out)."""
    out = {}
    for p in root.rglob("*"):
        st = p.lstat()
        out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), *(() if p.is_dir() else (st.st_size, st.st_mtime_ns)))
    return out


@pytest.fixture
def ws(sources, tmp_path, monkeypatch):
    hf, run = sources
    w = Workspace(tmp_path, hf, run)
    for d in (w.inputs, w.outputs, tmp_path / "cwd"):
        d.mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # anything a case writes by default lands here, and is caught
    return w


def header_file(header, body: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors-like file: an 8-byte length, ``header`` (JSON unless bytes), then ``body``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + body


def tensor(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"w": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


TRAIN = ["train", "--pp", "1", "--steps", "1", "--no-progress", "--seq-len", "16"]
CORPUS = [*TRAIN, "--model", "gpt-tiny"]
ZOO = [*CORPUS, "--data", "synthetic"]
PLAN = ["plan", "--pp", "2", "--seq-len", "16", "--tflops", "1"]
SIMULATE = ["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4"]
FULL = Path("/dev/full")
UNWRITABLE = "/proc/self/cannot-be-created"

CASES: list[tuple[str, str, object]] = []


def case(cls: str, name: str):
    def add(build):
        CASES.append((cls, name, build))
        return build
    return add


# -- 1. sizes mpt plan bounds, given to every command -------------------------------------------------------
for flag, value in (("--microbatches", 10**9), ("--microbatches", 65537), ("--pp", 10**6), ("--tp", 10**6),
                    ("--seq-len", 10**9), ("--chunks", 10**6), ("--micro-batch", 0)):
    CASES.append(("1 sizes", f"train {flag} {value}", lambda ws, f=flag, v=value: [*ZOO, f, str(v), "--dry-run"]))
for flag, value in (("--microbatches", 10**9), ("--pp", 10**9), ("--seq-len", 10**9)):
    CASES.append(("1 sizes", f"plan {flag} {value}", lambda ws, f=flag, v=value: [*PLAN, "--model", "gpt-tiny", f,
                                                                                   str(v)]))
    CASES.append(("1 sizes", f"simulate {flag} {value}", lambda ws, f=flag, v=value: (
        [*SIMULATE, f, str(v)] if f != "--seq-len" else [*SIMULATE, "--pp", str(10**7)])))
CASES.append(("1 sizes", "train --hf n_layer 10^9", lambda ws: [*TRAIN, "--hf", ws.hf_copy(config={"n_layer": 10**9})]))
CASES.append(("1 sizes", "train --layout auto --global-batch 10^14", lambda ws: [
    *ZOO, "--layout", "auto", "--global-batch", str(10**14), "--dry-run"]))  # hung: divisors found one by one
CASES.append(("1 sizes", "train --threads 10^5", lambda ws: [*ZOO, "--threads", str(10**5)]))  # a traceback
CASES.append(("1 sizes", "plan --search --global-batch 10^14", lambda ws: [
    "plan", "--search", "--devices", "2", "--model", "gpt-tiny", "--seq-len", "16", "--global-batch", str(10**14)]))


# -- 2. HF config.json values: the same check for mpt train --hf and mpt plan --model ----------------------
BAD_VALUES = {"negative": -1, "zero": 0, "string": "12", "float": 1.5, "bool": True, "list": [4]}
CONFIG_KEYS = {"gpt2": ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"),
               "llama": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"),
               "bert": ("hidden_size", "num_hidden_layers", "type_vocab_size")}
HUGE = {"gpt2": {"n_embd": 10**9}, "llama": {"intermediate_size": 10**13}, "bert": {"vocab_size": 10**12}}
ODD = {"gpt2": {"n_head": 5}, "llama": {"num_key_value_heads": 3}, "bert": {"num_attention_heads": 5},
       "gpt2-dropout": {"attn_pdrop": 1.5}, "gpt2-eps": {"layer_norm_epsilon": "x"},
       "bert-dropout": {"hidden_dropout_prob": -0.1}, "llama-eps": {"rms_norm_eps": 0}}


def _config_cases():
    edits = [(arch, f"{key}={label}", {key: value}) for arch, keys in CONFIG_KEYS.items() for key in keys
             for label, value in BAD_VALUES.items() if not (key == "type_vocab_size" and label == "zero")]
    edits += [(arch, f"{next(iter(e))} huge", e) for arch, e in HUGE.items()]
    edits += [(name.split("-")[0], f"{next(iter(e))}={next(iter(e.values()))!r}", e) for name, e in ODD.items()]
    for arch, label, edit in edits:
        CASES.append(("2 HF config", f"train --hf {arch} {label}",
                      lambda ws, a=arch, e=edit: [*TRAIN, "--hf", ws.hf_copy(a, config=e), "--data", "synthetic"]))
        CASES.append(("2 HF config", f"plan --model {arch} {label}",
                      lambda ws, a=arch, e=edit: [*PLAN, "--model", ws.hf_copy(a, config=e) / "config.json"]))


_config_cases()
for arch, edit in (("gpt2", {"activation_function": "nope"}), ("llama", {"hidden_act": "evil"}),
                   ("llama", {"rope_scaling": {"type": "evil", "factor": 2.0}})):  # KeyErrors from transformers' build
    CASES.append(("2 HF config", f"train --hf {arch} {next(iter(edit))}={next(iter(edit.values()))!r}",
                  lambda ws, a=arch, e=edit: [*TRAIN, "--hf", ws.hf_copy(a, config=e), "--data", "synthetic"]))


# -- 3. malformed but parseable headers: HF weights, checkpoint shards, token caches -------------------------
ST_HEADERS = {
    "a JSON list": header_file([1, 2]),
    "a JSON string": header_file("weights"),
    "a length past the file": header_file({}, length=1 << 62),
    "a length of zero": header_file(b"", length=0),
    "not JSON": header_file(b"{abc}"),
    "nested too deeply": header_file(b"[" * 100_000 + b"]" * 100_000),
    "an unknown dtype": header_file(tensor(dtype="OBJ"), b"\0" * 8),
    "a negative dimension": header_file(tensor(shape=(-2,)), b"\0" * 8),
    "a boolean dimension": header_file(tensor(shape=(True, 2)), b"\0" * 8),
    "a string dimension": header_file(tensor(shape=("2",)), b"\0" * 8),
    "offsets reversed": header_file(tensor(offsets=(8, 0)), b"\0" * 8),
    "offsets that do not hold the shape": header_file(tensor(shape=(3,)), b"\0" * 8),
    "a 10^24-element shape": header_file(tensor(shape=(10**12, 10**12)), b"\0" * 8),
    "data past the end": header_file(tensor(shape=(4,), offsets=(0, 16)), b"\0" * 8),
    "metadata that is not strings": header_file({"__metadata__": {"a": 1}, **tensor()}, b"\0" * 8),
    "seven bytes": b"\1" * 7,
    "no bytes": b"",
}
for label, payload in ST_HEADERS.items():
    CASES.append(("3 headers", f"--hf model.safetensors: {label}",
                  lambda ws, p=payload: [*TRAIN, "--hf", ws.hf_copy(weights=p), "--data", "synthetic"]))

INDEXES = {"not JSON": b"{", "a list": b"[]", "no weight_map": b"{}", "a shard outside the directory":
           json.dumps({"weight_map": {"lm_head.weight": "../model.safetensors"}}).encode(),
           "a pickled shard": json.dumps({"weight_map": {"lm_head.weight": "pytorch_model.bin"}}).encode(),
           "nested too deeply": b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"}


def _index_dir(ws, payload: bytes) -> Path:
    d = ws.hf_copy()
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_bytes(payload)
    return d


for label, payload in INDEXES.items():
    CASES.append(("3 headers", f"--hf index: {label}",
                  lambda ws, p=payload: [*TRAIN, "--hf", _index_dir(ws, p), "--data", "synthetic"]))


def _crafted_shard(ws, payload: bytes) -> Path:
    step = ws.checkpoint_copy()
    rel = "layers/h.0.safetensors"
    (step / rel).write_bytes(payload)
    reseal(step, rel)  # the manifest agrees: only the header itself can refuse it
    return step


for label in ("a JSON list", "a length past the file", "nested too deeply", "offsets that do not hold the shape",
              "data past the end", "seven bytes"):
    CASES.append(("3 headers", f"export, shard with {label}", lambda ws, p=ST_HEADERS[label]: [
        "export", "--checkpoint", _crafted_shard(ws, p), "--out", ws.outputs / "hf"]))
    CASES.append(("3 headers", f"resume, shard with {label}", lambda ws, p=ST_HEADERS[label]: [
        *ZOO, "--save-dir", _crafted_shard(ws, p).parent, "--resume", "latest", "--steps", "2"]))


# -- 4. files whose size agrees with a crafted manifest ------------------------------------------------------
def _sparse_shard(ws, declared_tensor: bool) -> Path:
    """A shard made a 50 GiB sparse file, its manifest's bytes set to match (and its hash left stale:
    nothing may be read far enough to find out)."""
    step = ws.checkpoint_copy()
    rel = "layers/h.0.safetensors"
    size = 50 << 30
    if declared_tensor:  # the header declares a tensor filling the file: the header check passes
        raw = json.dumps(tensor(shape=(size // 4 - 64,), offsets=(0, size - 256))).encode()
        head = struct.pack("<Q", len(raw)) + raw
        (step / rel).write_bytes(head)
        size = len(head) + size - 256
    with open(step / rel, "r+b") as f:
        f.truncate(size)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"][rel]["bytes"] = size
    (step / "manifest.json").write_text(json.dumps(manifest))
    return step


for declared in (False, True):
    what = "its header declaring a tensor that fills it" if declared else "its header unchanged"
    CASES.append(("4 sizes vs headers", f"export, a 50 GiB sparse shard, {what}", lambda ws, d=declared: [
        "export", "--checkpoint", _sparse_shard(ws, d), "--out", ws.outputs / "hf"]))
    CASES.append(("4 sizes vs headers", f"resume, a 50 GiB sparse shard, {what}", lambda ws, d=declared: [
        *ZOO, "--save-dir", _sparse_shard(ws, d).parent, "--resume", "latest", "--steps", "2"]))


def _recorded_model(ws, key: str, value) -> Path:
    """A checkpoint whose manifest records a model config with ``key`` set to ``value`` (the manifest is not
    hashed: export builds the model it records)."""
    step = ws.checkpoint_copy()
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["meta"]["model"]["config"][key] = value
    (step / "manifest.json").write_text(json.dumps(manifest))
    return step


for key, value in (("n_layer", 10**9), ("n_embd", 10**9), ("n_embd", "x"), ("activation_function", "nope")):
    CASES.append(("1 sizes", f"export, a manifest recording {key}={value!r}", lambda ws, k=key, v=value: [
        "export", "--checkpoint", _recorded_model(ws, k, v), "--out", ws.outputs / "hf"]))


def _manifest_bytes(ws, value) -> Path:
    step = ws.checkpoint_copy()
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["layers/h.0.safetensors"]["bytes"] = value
    (step / "manifest.json").write_text(json.dumps(manifest))
    return step


for value in (1 << 60, -1, 0, "8"):
    CASES.append(("4 sizes vs headers", f"export, manifest bytes {value!r}", lambda ws, v=value: [
        "export", "--checkpoint", _manifest_bytes(ws, v), "--out", ws.outputs / "hf"]))


# -- 5. nesting ----------------------------------------------------------------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _deep_hf_config(ws) -> list:
    d = ws.hf_copy()
    _write(d / "config.json", '{"model_type": "gpt2", "x": ' + DEEP + "}")
    return [*TRAIN, "--hf", d, "--data", "synthetic"]


CASES += [
    ("5 nesting", "--config nested", lambda ws: [
        *ZOO, "--config", _write(ws.inputs / "ds.json", '{"x": ' + DEEP + "}")]),
    ("5 nesting", "--cluster nested", lambda ws: [*PLAN, "--model", "gpt-tiny", "--cluster",
                                                  _write(ws.inputs / "c.json", '{"nodes": ' + DEEP + "}")]),
    ("5 nesting", "plan --model config nested", lambda ws: [
        *PLAN, "--model", _write(ws.inputs / "config.json", '{"model_type": "gpt2", "x": ' + DEEP + "}")]),
    ("5 nesting", "--hf config nested", _deep_hf_config),
    ("5 nesting", "--plan FILE nested", lambda ws: [*ZOO, "--plan", _write(ws.inputs / "search.json", DEEP)]),
    ("5 nesting", "--tokenizer nested", lambda ws: [
        *CORPUS, "--data", _write(ws.inputs / "c.txt", "hello world " * 500), "--cache-dir", ws.outputs,
        "--tokenizer", _write(ws.inputs / "tokenizer.json", '{"model": ' + DEEP + "}")]),
    ("5 nesting", "JSON-lines corpus nested", lambda ws: [
        *CORPUS, "--data", _write(ws.inputs / "c.jsonl", '{"text": ' + DEEP + "}\n"), "--cache-dir", ws.outputs]),
    ("5 nesting", "checkpoint manifest nested", lambda ws: [
        "export", "--checkpoint", _write(ws.checkpoint_copy() / "manifest.json", DEEP).parent, "--out",
        ws.outputs / "hf"]),
]


# -- 6. numbers out of range ---------------------------------------------------------------------------------
for flag, value in (("--initial-scale-power", "100000"), ("--initial-scale-power", "-1"), ("--loss-scale-window", "0"),
                    ("--hysteresis", "0"), ("--clip-grad", "-1"), ("--clip-grad", "nan"), ("--lr", "1e400"),
                    ("--dp-bucket-mb", "0"), ("--zero", "3"), ("--warmup-steps", "-5"), ("--seed", str(10**23))):
    CASES.append(("6 numbers", f"train {flag} {value}", lambda ws, f=flag, v=value: [
        *ZOO, "--precision", "fp16", f, v]))
def _ds(ws, top: dict, fp16: dict) -> Path:
    doc = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, **top,
           "fp16": {"enabled": True, **fp16}}
    return _write(ws.inputs / "ds.json", json.dumps(doc))


for key, value in (("initial_scale_power", 100000), ("loss_scale_window", 0)):
    CASES.append(("6 numbers", f"--config fp16.{key} {value}", lambda ws, k=key, v=value: [
        *ZOO, "--config", _ds(ws, {}, {k: v})]))
for key, value in (("train_micro_batch_size_per_gpu", 10**12), ("gradient_accumulation_steps", 10**9)):
    CASES.append(("6 numbers", f"--config {key} {value}", lambda ws, k=key, v=value: [
        *ZOO, "--config", _ds(ws, {k: v}, {})]))


# -- 7. outputs that cannot be written -----------------------------------------------------------------------
def _a_dir(ws) -> Path:
    d = ws.outputs / "a-directory"
    d.mkdir()
    return d


OUT_TARGETS = {"a full device": lambda ws: FULL, "a place that cannot be created": lambda ws: UNWRITABLE,
               "a directory": _a_dir}
for target, where in OUT_TARGETS.items():
    for flag in ("--metrics", "--csv", "--plot"):
        CASES.append(("7 outputs", f"train {flag} to {target}", lambda ws, f=flag, w=where: [*ZOO, f, w(ws)]))
    CASES.append(("7 outputs", f"plan --json to {target}", lambda ws, w=where: [*PLAN, "--model", "gpt-tiny", "--json",
                                                                                w(ws)]))
    CASES.append(("7 outputs", f"simulate --json to {target}", lambda ws, w=where: [*SIMULATE, "--json", w(ws)]))
CASES += [
    ("7 outputs", "train --tensorboard at a full device", lambda ws: [*ZOO, "--tensorboard", FULL]),
    ("7 outputs", "train --tensorboard at a file", lambda ws: [*ZOO, "--tensorboard", _write(ws.outputs / "tb", "")]),
    ("7 outputs", "train --tensorboard where nothing can be created", lambda ws: [*ZOO, "--tensorboard", UNWRITABLE]),
    ("7 outputs", "plan --gantt where nothing can be created", lambda ws: [
        *PLAN, "--model", "gpt-tiny", "--gantt", UNWRITABLE + ".png"]),
    ("7 outputs", "simulate --gantt where nothing can be created", lambda ws: [
        *SIMULATE, "--gantt", UNWRITABLE + ".svg"]),
    ("7 outputs", "export --out where nothing can be created", lambda ws: [
        "export", "--checkpoint", ws.checkpoint_copy().parent, "--out", UNWRITABLE]),
    ("7 outputs", "export --out a file", lambda ws: [
        "export", "--checkpoint", ws.checkpoint_copy().parent, "--out", _write(ws.outputs / "f", "x")]),
    ("7 outputs", "--save-dir a file", lambda ws: [*ZOO, "--save-dir", _write(ws.outputs / "f", "x")]),
]


# -- 8. links ------------------------------------------------------------------------------------------------
def _linked_weights(ws) -> Path:
    d = ws.hf_copy()
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(_write(ws.inputs / "secret.txt", "a file outside the directory\n"))
    return d


def _linked_out(ws) -> Path:
    real = ws.outputs / "real"
    real.mkdir()
    (ws.outputs / "link").symlink_to(real)
    return ws.outputs / "link"


def _linked_config(ws) -> Path:
    d = ws.hf_copy()
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(_write(ws.inputs / "not-a-config", "# a shell script\n"))
    return d


CASES += [
    ("8 links", "--hf model.safetensors linked to a file outside", lambda ws: [
        *TRAIN, "--hf", _linked_weights(ws), "--data", "synthetic"]),
    ("8 links", "--hf config.json linked to a file outside", lambda ws: [
        *TRAIN, "--hf", _linked_config(ws), "--data", "synthetic"]),
    ("8 links", "export --out a link to a directory", lambda ws: [
        "export", "--checkpoint", ws.checkpoint_copy().parent, "--out", _linked_out(ws), "--force"]),
    ("8 links", "--data a link to a FIFO", lambda ws: [
        *CORPUS, "--data", _link(ws, fifo(ws.inputs / "fifo"), "corpus.txt"), "--cache-dir", ws.outputs]),
    ("8 links", "a checkpoint shard linked outside", lambda ws: [
        "export", "--checkpoint", _linked_shard(ws), "--out", ws.outputs / "hf"]),
]


def _link(ws, target: Path, name: str = "link") -> Path:
    (ws.inputs / name).symlink_to(target)
    return ws.inputs / name


def _linked_shard(ws) -> Path:
    step = ws.checkpoint_copy()
    shard = step / "layers" / "h.0.safetensors"
    outside = ws.inputs / "outside.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    return step


# -- 9. FIFOs, devices and misleading places -----------------------------------------------------------------
def _special_in_hf(ws, name: str) -> Path:
    d = ws.hf_copy()
    (d / name).unlink(missing_ok=True)
    fifo(d / name)
    return d


CASES += [
    ("9 special files", "--hf model.safetensors a FIFO", lambda ws: [
        *TRAIN, "--hf", _special_in_hf(ws, "model.safetensors"), "--data", "synthetic"]),
    ("9 special files", "--hf config.json a FIFO", lambda ws: [
        *TRAIN, "--hf", _special_in_hf(ws, "config.json"), "--data", "synthetic"]),
    ("9 special files", "--hf index a FIFO", lambda ws: [
        *TRAIN, "--hf", _special_in_hf(ws, "model.safetensors.index.json"), "--data", "synthetic"]),
    ("9 special files", "--hf a device", lambda ws: [*TRAIN, "--hf", "/dev/null", "--data", "synthetic"]),
    ("9 special files", "--data a FIFO", lambda ws: [
        *CORPUS, "--data", fifo(ws.inputs / "corpus.txt"), "--cache-dir", ws.outputs]),
    ("9 special files", "--data an endless device", lambda ws: [
        *CORPUS, "--data", _link(ws, Path("/dev/zero"), "zeros.txt"), "--cache-dir", ws.outputs]),
    ("9 special files", "--data a folder holding a FIFO", lambda ws: [
        *CORPUS, "--data", fifo(ws.inputs / "a.jsonl").parent, "--cache-dir", ws.outputs]),
    ("9 special files", "--config a FIFO", lambda ws: [*ZOO, "--config", fifo(ws.inputs / "ds.json")]),
    ("9 special files", "--config a device", lambda ws: [*ZOO, "--config", "/dev/zero"]),
    ("9 special files", "plan --model a FIFO", lambda ws: [*PLAN, "--model", fifo(ws.inputs / "config.json")]),
    ("9 special files", "--cluster a FIFO", lambda ws: [*PLAN, "--model", "gpt-tiny", "--cluster",
                                                        fifo(ws.inputs / "c.json")]),
    ("9 special files", "--tokenizer a FIFO", lambda ws: [
        *CORPUS, "--data", _write(ws.inputs / "c.txt", "hello world " * 500), "--tokenizer",
        fifo(ws.inputs / "tok.json"), "--cache-dir", ws.outputs]),
    ("9 special files", "--save-dir /proc/self", lambda ws: [*ZOO, "--save-dir", "/proc/self"]),
    ("9 special files", "--plan a FIFO", lambda ws: [*ZOO, "--plan", fifo(ws.inputs / "search.json")]),
    ("9 special files", "export --tokenizer a FIFO", lambda ws: [  # it hung
        "export", "--checkpoint", ws.checkpoint_copy().parent, "--out", ws.outputs / "hf", "--tokenizer",
        fifo(ws.inputs / "tokenizer.json")]),
    ("9 special files", "--save-dir a FIFO", lambda ws: [*ZOO, "--save-dir", fifo(ws.outputs / "fifo")]),
    ("9 special files", "export --checkpoint a FIFO", lambda ws: [
        "export", "--checkpoint", fifo(ws.inputs / "fifo"), "--out", ws.outputs / "hf"]),
    ("9 special files", "--resume a FIFO", lambda ws: [*ZOO, "--resume", fifo(ws.inputs / "fifo")]),
]


# -- prepared corpora (`mpt data prepare` DIRs) and the command itself, in the classes above ---------------------
IDX = "train/f00000-c00000.idx"


def _patch(path: Path, at: int, raw: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + len(raw)] = raw
    path.write_bytes(bytes(data))


PREPARED_DAMAGE = {
    ("3 headers", "an .idx declaring 10^15 sequences"): lambda d: _patch(d / IDX, 18, struct.pack("<Q", 10**15)),
    ("3 headers", "an .idx with flipped bytes"): lambda d: _patch(d / IDX, 40, b"\xff\xff"),
    ("3 headers", "a .bin cut in half"): lambda d: (d / IDX.replace(".idx", ".bin")).write_bytes(
        (d / IDX.replace(".idx", ".bin")).read_bytes()[:100]),
    ("3 headers", "a manifest that is a list"): lambda d: _write(d / "manifest.json", "[1]"),
    ("5 nesting", "a manifest nested too deeply"): lambda d: _write(d / "manifest.json", DEEP),
}
for (cls, label), damage in PREPARED_DAMAGE.items():
    CASES.append((cls, f"--data prepared DIR with {label}", lambda ws, f=damage: [
        *TRAIN, "--model", "gpt-tiny", "--seq-len", "32", "--data", ws.prepared_copy(f)]))
    CASES.append((cls, f"data verify, {label}", lambda ws, f=damage: ["data", "verify", ws.prepared_copy(f)]))

PREPARE = ["data", "prepare", "--no-progress", "--workers", "1"]
CASES += [
    ("1 sizes", "data prepare --vocab-size 10^11", lambda ws: [  # aborted the process: a Rust panic
        *PREPARE, "--input", _write(ws.inputs / "c.txt", "hello world " * 50), "--output", ws.outputs / "p",
        "--vocab-size", str(10**11)]),
    ("1 sizes", "data prepare --workers 10^5", lambda ws: [
        "data", "prepare", "--no-progress", "--input", _write(ws.inputs / "c.txt", "hello world " * 50), "--output",
        ws.outputs / "p", "--vocab-size", "300", "--workers", str(10**5)]),
    ("7 outputs", "data prepare --output where nothing can be created", lambda ws: [
        *PREPARE, "--input", _write(ws.inputs / "c.txt", "hello world " * 50), "--output", UNWRITABLE,
        "--vocab-size", "300"]),
    ("9 special files", "data prepare --output a FIFO", lambda ws: [
        *PREPARE, "--input", _write(ws.inputs / "c.txt", "hello world " * 50), "--output", fifo(ws.outputs / "p"),
        "--vocab-size", "300"]),
    ("3 headers", "data prepare into a DIR whose prepare.json is a list", lambda ws: [
        *PREPARE, "--input", _write(ws.inputs / "c.txt", "hello world " * 50), "--output",
        _write(_mkdir(ws.outputs / "p") / "prepare.json", "[1]").parent, "--vocab-size", "300"]),
]


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


# -- 10. unusable corpora (memory is measured below, in processes of their own) ------------------------------
def _bytes(ws, name: str, data: bytes) -> Path:
    (ws.inputs / name).write_bytes(data)
    return ws.inputs / name


for name, data in (("random.txt", os.urandom(1 << 20)), ("random.jsonl", os.urandom(1 << 20)),
                   ("random.txt.gz", os.urandom(1 << 16)), ("latin1.txt", "café ".encode("latin-1") * 1000),
                   ("nul.jsonl", b"\0" * 4096), ("empty.txt", b""), ("line.jsonl", b'{"text": 5}\n')):
    CASES.append(("10 corpora", f"--data {name}", lambda ws, n=name, d=data: [
        *CORPUS, "--data", _bytes(ws, n, d), "--cache-dir", ws.outputs]))


# -- damaged caches: rebuilt, not obeyed (the run trains) ----------------------------------------------------
REBUILT = [("3 headers", f"token cache {part}.npy {how}", part, how) for part in ("e0-shuffle", "e0-documents")
           for how in ("declares 10^12 ids", "has a flipped header byte", "is truncated")]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("cls, name, build", CASES, ids=[f"{c[:2].strip()}-{n}" for c, n, _ in CASES])
def test_hostile_input_ends_in_one_line(ws, capsys, cls, name, build):
    argv = [str(a) for a in build(ws)]
    if any(a in (str(FULL),) for a in argv) and not FULL.is_char_device():
        pytest.skip("no /dev/full on this machine")
    before = _tree(ws.inputs)
    start = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code not in (0, None) and "Traceback" not in err, (argv, code, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith(f"mpt {argv[0]}: error:") or lines[0].startswith("mpt: error:"), (
        argv, err[-2000:])
    assert took < TIMEOUT_S
    assert _tree(ws.inputs) == before, "an input was changed"
    assert list((ws.root / "cwd").iterdir()) == [], "written outside the paths named"
    assert sorted(p.name for p in ws.root.iterdir()) == ["cwd", "in", "out"]


def _damage_npy(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how.startswith("declares"):
        n = int.from_bytes(raw[8:10], "little")
        text = raw[10:10 + n].decode("latin1")
        text = text[:text.index("(")] + "(1000000000000,), }"
        raw[10:10 + n] = (text + " " * (n - len(text) - 1) + "\n").encode("latin1")
    elif how.startswith("has a flipped"):
        raw[30] ^= 0x55
    else:
        raw = raw[:len(raw) // 2]
    path.write_bytes(bytes(raw))


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("cls, name, part, how", REBUILT, ids=[r[1] for r in REBUILT])
def test_a_damaged_token_cache_is_rebuilt(ws, capsys, cls, name, part, how):
    corpus = _write(ws.inputs / "c.txt", "\n".join(f"line {i} of the corpus, word{i % 37}" for i in range(400)))
    argv = [*CORPUS, "--data", str(corpus), "--cache-dir", str(ws.outputs)]
    assert main(argv) == 0
    first = capsys.readouterr().out
    (cache,) = ws.outputs.rglob(f"{part}.npy")
    _damage_npy(cache, how)
    assert main(argv) == 0
    again = capsys.readouterr()
    assert "Traceback" not in again.err
    loss = [line for line in first.splitlines() if line.startswith("loss ")]
    assert loss and loss[0].split(",")[0] in again.out  # the same first loss: the same samples


def test_the_campaign_counts_by_class():
    """At least 150 cases (issue 40); the counts by class are RELIABILITY.md's table."""
    counts = Counter(cls for cls, _, _ in CASES) + Counter(cls for cls, *_ in REBUILT)
    print("\n".join(f"{cls}: {n}" for cls, n in sorted(counts.items())))
    assert sum(counts.values()) >= 150 and len(counts) == 10, counts


LARGE = 256 << 20
"""The unusable corpora of the memory test: large enough that holding one twice would show."""


def _peak_rss_of(argv: list[str], cwd: Path) -> tuple[int, str, int]:
    """(exit code, stderr, peak resident bytes) of ``mpt argv`` run in a process of its own."""
    probe = ("import resource, subprocess, sys\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "sys.stdout.write(f'{p.returncode}\\n{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\\n')\n"
             "sys.stdout.write(p.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "mp_toolkit.cli", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    code, peak, err = done.stdout.split("\n", 2)
    return int(code), err, int(peak) * 1024


def test_refusing_a_large_unusable_corpus_holds_at_most_its_size(tmp_path):
    """Issue 40, class 10: refusing a 256 MiB corpus of random bytes (text, JSON lines), one 128 MiB JSON
    line of the wrong type or one 256 MiB line (longer than a line may be) holds at most max(the file's size,
    512 MB) above what refusing a 1 KiB one holds."""
    def corpus(name: str, data) -> Path:
        path = tmp_path / name
        with open(path, "wb") as f:
            for _ in range(LARGE >> 20):
                f.write(data())
        return path

    small = tmp_path / "small.txt"
    small.write_bytes(os.urandom(1024))
    base = ["train", "--model", "gpt-tiny", "--pp", "1", "--steps", "1", "--no-progress", "--cache-dir",
            str(tmp_path / "cache")]
    code, err, floor = _peak_rss_of([*base, "--data", str(small)], tmp_path)
    assert code == 2 and "not UTF-8" in err, err
    for name in ("random.txt", "random.jsonl", "one-line.jsonl", "long-line.jsonl"):
        if name.endswith("line.jsonl"):  # a line is held whole: 128 MiB, the longest taken; 256 MiB, refused
            path = tmp_path / name
            pad = b"x" * (MAX_JSON_LINE - 32 if name == "one-line.jsonl" else LARGE)
            path.write_bytes(b'{"text": 5, "pad": "' + pad + b'"}\n')
        else:
            path = corpus(name, lambda: os.urandom(1 << 20))
        code, err, peak = _peak_rss_of([*base, "--data", str(path)], tmp_path)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "error:" in lines[0], err
        print(f"{name}: {path.stat().st_size / 2**20:.0f} MiB refused, peak {(peak - floor) / 2**20:.0f} MiB above "
              f"refusing 1 KiB ({floor / 2**20:.0f} MiB)")
        assert peak - floor <= max(path.stat().st_size, 512e6), (path.name, peak, floor)
        path.unlink()


def test_a_signal_during_start_up_stops_mpt_train_within_a_second(tmp_path):
    """Issue 40: SIGTERM to `mpt train` while its rank builds a model (gpt2: seconds) ends the job within a
    second: nothing is trained, nothing saved, at most one line."""
    job = subprocess.Popen([sys.executable, "-m", "mp_toolkit.cli", "train", "--model", "gpt2", "--pp", "1",
                            "--seq-len", "32", "--data", "synthetic", "--steps", "2", "--no-progress"], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for line in job.stdout:  # the rank names the model as its build starts
            if line.startswith("model gpt2"):
                break
        sent = time.monotonic()
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    err = job.stderr.read()
    assert code in (128 + signal.SIGTERM, -signal.SIGTERM) and "Traceback" not in err, (code, err)
    assert len(err.strip().splitlines()) <= 1 and took < 1.0, (took, err)


def test_plan_simulate_and_train_refuse_too_many_microbatches_in_the_same_words(capsys):
    """One bound, one line: what `mpt plan` and `mpt simulate` say, `mpt train` says."""
    said = set()
    for argv in ([*PLAN, "--model", "gpt-tiny"], SIMULATE, [*ZOO, "--dry-run"]):
        assert main([*argv, "--microbatches", str(10**9)]) == 2
        said.add(capsys.readouterr().err.split("error: ", 1)[1])
    assert len(said) == 1 and "at most 65536" in said.pop()


@pytest.mark.skipif(not FULL.is_char_device(), reason="no /dev/full on this machine")
def test_a_metrics_write_failing_mid_run_stops_every_rank_with_one_line(tmp_path):
    """pp 2: rank 0's failed write of a step's row is agreed on by every rank at that step (as a failed save
    is), so the job ends with rank 0's line alone, not one `lost rank 0` line from each other rank."""
    done = subprocess.run([sys.executable, "-m", "mp_toolkit.cli", "train", "--model", "gpt-tiny", "--pp", "2",
                           "--schedule", "1f1b", "--seq-len", "32", "--steps", "3", "--data", "synthetic",
                           "--no-progress", "--metrics", str(FULL)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines == [f"mpt train: error: --metrics {FULL}: cannot write it (No space left "
                                              "on device): choose a path you can write, on a device with room"], (
        done.returncode, done.stderr)


# -- hypothesis: random headers and config values, at the readers themselves ---------------------------------
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                      st.floats(allow_nan=False), st.text(max_size=6))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=4), inner, max_size=3), max_leaves=8)
entry = st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8", "x"]),
                               "shape": st.lists(st.integers(min_value=-2, max_value=2**40), max_size=3),
                               "data_offsets": st.lists(st.integers(min_value=-2, max_value=2**40), max_size=3)})
header_doc = st.one_of(json_value, st.dictionaries(st.text(max_size=5), st.one_of(entry, json_value), max_size=4))


@settings(max_examples=300, deadline=None)
@given(doc=header_doc, body=st.integers(min_value=0, max_value=64),
       length=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_random_safetensors_headers_are_read_or_refused_in_one_line(doc, body, length):
    """`parse_header` (HF weights and checkpoint shards): any header is an answer or one ValueError line."""
    data = header_file(json.dumps(doc).encode(), b"\0" * body, length)
    try:
        n, header, _ = parse_header(data, len(data))
    except ValueError as e:
        assert "\n" not in str(e)
    else:
        assert n == len(data) - 8 - body and all(isinstance(e["shape"], list) for e in header.values())


config_values = st.one_of(st.integers(min_value=-3, max_value=10**14), st.floats(allow_nan=True), st.booleans(),
                          st.none(), st.text(max_size=4), st.lists(st.integers(), max_size=2))


@settings(max_examples=150, deadline=None)
@given(arch=st.sampled_from(["gpt2", "llama", "bert"]),
       edit=st.dictionaries(st.sampled_from([*SIZE_KEYS, *DROPOUT_KEYS, *EPSILON_KEYS]), config_values, max_size=3))
def test_random_hf_config_values_are_taken_or_refused_in_one_line(arch, edit):
    """`load_config` (`mpt train --hf`, `mpt export --config`) with random values of the keys it checks: an HF
    config whose shape the cost model reads within its bounds, or one ValueError line; never a traceback from
    transformers."""
    doc = {**json.loads(tiny_hf_config_json(arch)), **edit}
    try:
        config = load_config(doc)
    except ValueError as e:
        assert "\n" not in str(e)
    else:
        assert shape_from_hf_config(config.to_dict()).num_layers >= 1


def tiny_hf_config_json(arch: str) -> str:
    return _TINY_CONFIGS.setdefault(arch, tiny_hf(
        {"gpt2": "gpt2", "llama": "llama", "bert": "bert-pretraining"}[arch], seed=0).config.to_json_string())


_TINY_CONFIGS: dict[str, str] = {}
