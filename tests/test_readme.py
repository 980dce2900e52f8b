"""Every shell command of the README and the recipes' READMEs runs as written (issue 21 item 5).

Each fenced ``bash`` block is read, its commands are joined over ``\\`` continuations, and each is run:

- ``mpt train``, ``torchrun`` on this machine, a recipe's ``run.sh --smoke``: for real, at smoke size
  (``--steps 1``; one rank thread), in a temporary directory so relative outputs land there;
- ``mpt plan`` / ``mpt simulate``: in this process (placeholder paths replaced by a real config);
- ``mpt data prepare``: for real, in the document's folder (its output is what the next commands train on),
  a trained tokenizer's sample cut to 1 MB (smoke size);
- ``make demo`` / ``make test``: ``make -n`` names the command; the demo's ``mpt train`` runs at smoke
  size (``make test`` cannot run inside itself);
- commands for GPUs, several nodes or a corpus under ``/data``: ``run.sh`` with ``DEEPSPEED=echo``
  prepares its corpus (``DATA`` under ``/data``: this repository's sources; ``TOKENIZER``: one
  ``recipes/make_tokenizer.py`` builds; ``WORK``: a temporary directory) and prints the launcher
  command, which must equal the README's last ``# =`` line, and ``train.py ... --dry-run`` checks it
  as the launcher's rank 0 would (``RANK``/``WORLD_SIZE`` of the GPUs named).

A command no rule matches fails the test, so a new README command needs a rule here.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mp_toolkit.cli import main
from mp_toolkit.run.launch import free_port
from tests import test_recipes
from tests.mpt_command import run_mpt

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "recipes/gpt_pretrain/README.md", "recipes/bert_pretrain/README.md")
BIN = Path(sys.executable).parent
SMOKE = ["--steps", "1", "--threads", "1", "--no-progress"]
COVERED = {("recipes/gpt_pretrain/README.md", "./run.sh --smoke"):
           test_recipes.test_gpt_recipe_smoke_under_the_deepspeed_launcher}
"""Commands another test runs in full (30 steps, the loss checked): not run a second time here."""


CACHE: list[str] = []
"""One tokenizer / token cache for every command here (trained once, as a user's would be)."""


@pytest.fixture(scope="module", autouse=True)
def shared_cache(tmp_path_factory):
    CACHE[:] = [str(tmp_path_factory.mktemp("readme-cache"))]


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str
    expansion: str | None  # the ``# = ...`` comment under it: what run.sh runs

    @property
    def where(self) -> Path:
        return (ROOT / self.doc).parent


def read_commands(doc: str) -> list[Command]:
    """The commands of ``doc``'s ``bash`` blocks, continuations joined, comments dropped."""
    out: list[Command] = []
    block = False
    pending: list[str] = []
    start = 0
    for n, raw in enumerate((ROOT / doc).read_text().splitlines(), 1):
        if raw.startswith("```"):
            block = raw.strip() == "```bash"
            continue
        if not block:
            continue
        line = raw.strip()
        if line.startswith("# ="):
            out[-1] = Command(out[-1].doc, out[-1].line, out[-1].text, line[3:].removesuffix("\\").strip())
            continue
        if line.startswith("#") and out and out[-1].expansion is not None and not pending:
            more = line[1:].removesuffix("\\").strip()
            out[-1] = Command(out[-1].doc, out[-1].line, out[-1].text, f"{out[-1].expansion} {more}")
            continue
        if not line or line.startswith("#"):
            continue
        if not pending:
            start = n
        pending.append(line.split(" # ")[0].split("  #")[0].rstrip().removesuffix("\\").strip())
        if not line.split(" # ")[0].rstrip().endswith("\\"):
            out.append(Command(doc, start, " ".join(pending), None))
            pending = []
    assert not pending, f"{doc}: a command ends in a continuation"
    return out


ALL = [c for doc in DOCS for c in read_commands(doc)]


def env(**extra) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MPT_FAULTS")}
    return {**base, "PATH": f"{BIN}{os.pathsep}{base['PATH']}", "OMP_NUM_THREADS": "1", **extra}


def run(argv: list[str], cwd: Path, timeout: float = 240, **extra) -> str:
    """Run ``argv`` in its own session; the whole group is killed on a timeout."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{argv[:3]} ran past {timeout}s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{out[-3000:]}"
    return out


def smoke_train(words: list[str], cwd: Path, tmp_path: Path) -> str:
    """``mpt train ...`` as written plus the smoke flags, as a process of its own (`tests.mpt_command`)."""
    argv = [*words[1:], *SMOKE, "--cache-dir", CACHE[0]]
    r = run_mpt(argv, env=env(), cwd=cwd, timeout=240, merge_stderr=True)
    assert r.returncode == 0, f"mpt {shlex.join(argv)} exited {r.returncode}:\n{r.stdout[-3000:]}"
    return r.stdout


def launcher_dry_run(args: list[str], cwd: Path, world: int, local: int) -> str:
    """``train.py args --dry-run`` as the launcher's rank 0 of ``world`` ranks would run it."""
    return run([sys.executable, "train.py", *args, "--dry-run"], cwd, RANK="0", LOCAL_RANK="0",
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local))


def real_paths(words: list[str], tmp_path: Path) -> list[str]:
    """A corpus under /data becomes this repository's sources; /shared and runs/ outputs go to tmp."""
    return [str(ROOT / "mp_toolkit") if w.startswith("/data/") else
            str(tmp_path / w.lstrip("/")) if w.startswith("/shared/") else w for w in words]


def recipe_env(assigned: dict[str, str], where: Path, tmp_path: Path) -> dict[str, str]:
    """A production run.sh's environment here: the corpus under /data is this repository's sources, its
    TOKENIZER one built locally for the recipe's model, and what it prepares goes to tmp (WORK)."""
    kind = "wordpiece" if where.name.startswith("bert") else "bpe"
    tokenizer = tmp_path / "tokenizer"
    run([sys.executable, str(ROOT / "recipes" / "make_tokenizer.py"), "--kind", kind, "--vocab-size", "512",
         "--input", str(ROOT / "mp_toolkit"), "--out", str(tokenizer)], where)
    real = {k: str(ROOT / "mp_toolkit") if v.startswith("/data/") else v for k, v in assigned.items()}
    return {**real, "TOKENIZER": str(tokenizer), "WORK": str(tmp_path / "runs"), "WORKERS": "1"}


def check_run_sh(cmd: Command, words: list[str], tmp_path: Path) -> str:
    """run.sh prepares its corpus, then prints (DEEPSPEED=echo) the README's last ``# =`` command, the
    launcher's; smoke runs run, others are dry-run."""
    assigned = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    args = [w for w in words if not re.match(r"^[A-Z_]+=", w)][1:]
    if "--smoke" not in args:
        assigned = recipe_env(assigned, cmd.where, tmp_path)
    out = run(["./run.sh", *args], cmd.where, DEEPSPEED="echo", MASTER_PORT="29500", **assigned)
    launched = [w.removeprefix(f"{cmd.where}/") for w in out.strip().splitlines()[-1].split()]
    printed = [w.removeprefix(f"{tmp_path}/") for w in launched]  # WORK's runs/ reads as the README's
    written = [w for w in shlex.split(cmd.expansion) if not re.match(r"^[A-Z_]+=", w)]
    assert written[0] == "deepspeed" and printed == written[1:], (printed, written)
    if "--smoke" in args:
        if (cmd.doc, cmd.text) in COVERED:
            return f"run in full by {COVERED[(cmd.doc, cmd.text)].__name__}"
        return run(["./run.sh", *args, *SMOKE, "--cache-dir", CACHE[0]], cmd.where,
                   DEEPSPEED=str(BIN / "deepspeed"), MASTER_PORT=str(free_port()))
    gpus = int(launched[launched.index("--num_gpus") + 1])
    entry = launched.index("train.py")
    return launcher_dry_run(real_paths(launched[entry + 1:], tmp_path), cmd.where, gpus, gpus)


def check_torchrun(cmd: Command, words: list[str], tmp_path: Path) -> str:
    entry = next(i for i, w in enumerate(words) if w in ("train.py", "-m"))
    opts = dict(zip(words[1:entry:2], words[2:entry:2]))
    nodes, nproc = int(opts.get("--nnodes", 1)), int(opts["--nproc_per_node"])
    if nodes > 1:  # another machine is named: rank 0's checks only
        return launcher_dry_run(real_paths(words[entry + 1:], tmp_path), cmd.where, nodes * nproc, nproc)
    return run([str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), *words[entry:], *SMOKE, "--cache-dir", CACHE[0]],
               cmd.where)


def check_mpt(cmd: Command, words: list[str], tmp_path: Path, monkeypatch, capsys) -> str:
    if words[1] == "train":
        return smoke_train(words, cmd.where, tmp_path)
    if words[1] == "data":  # a process of its own (its encoding pool cannot start under run_mpt's daemon)
        smoke = ["--tokenizer-sample-bytes", "1000000"] if "--vocab-size" in words else []  # a smaller BPE sample
        return run([sys.executable, "-m", "mp_toolkit.cli", *words[1:], *smoke, "--no-progress"], cmd.where)
    config = tmp_path / "config.json"  # the README's path/to/config.json: a small GPT's
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4,
                                  "n_positions": 128, "vocab_size": 512}))
    monkeypatch.chdir(tmp_path)
    argv = [str(config) if w == "path/to/config.json" else w for w in words[1:]]
    if words[1] == "plan" and "--method" in argv and argv[argv.index("--method") + 1] == "time":
        argv += ["--seq-len", "64", "--threads", "1"]  # measured: a small batch
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def check_make(cmd: Command, words: list[str], tmp_path: Path) -> str:
    target = words[1]
    recipe = run(["make", "-n", target, f"VENV={Path(sys.executable).parents[1]}"], ROOT)
    if target == "test":
        assert "-m pytest" in recipe, recipe
        return recipe
    line = next(ln for ln in recipe.replace("\\\n", " ").splitlines() if " train " in ln)
    words = shlex.split(line)
    words = ["mpt", *words[words.index("train"):]]
    return smoke_train(words, tmp_path, tmp_path)


@pytest.mark.parametrize("cmd", ALL, ids=[f"{c.doc}:{c.line}" for c in ALL])
def test_readme_command_runs(cmd: Command, tmp_path, monkeypatch, capsys):
    words = shlex.split(cmd.text)
    program = next(w for w in words if not re.match(r"^[A-Z_]+=", w))
    if program == "make":
        out = check_make(cmd, words, tmp_path)
    elif program == "mpt":
        out = check_mpt(cmd, words, tmp_path, monkeypatch, capsys)
    elif program == "torchrun":
        out = check_torchrun(cmd, words, tmp_path)
    elif program == "./run.sh":
        out = check_run_sh(cmd, words, tmp_path)
    else:
        pytest.fail(f"{cmd.doc}:{cmd.line}: no rule runs {program!r} ({cmd.text}): add one to tests/test_readme.py")
    print(f"{cmd.doc}:{cmd.line}: {cmd.text}\n{out.strip()[-1500:]}")


def test_every_document_has_commands():
    """The reader finds the blocks (a renamed fence would silently leave nothing to run)."""
    assert {c.doc for c in ALL} == set(DOCS) and len(ALL) >= 15, [(c.doc, c.text) for c in ALL]


def test_readme_schedule_example_prints_what_it_says(tmp_path, monkeypatch, capsys):
    """The README's self-contained Python block runs, and its commented figure is what it prints."""
    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "get_schedule" in b)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    said = re.search(r"print\(t\.bubble_fraction\)\s+# ([0-9.]+)", block).group(1)
    printed = float(capsys.readouterr().out.split()[-1])
    assert f"{printed:.3f}" == said, (printed, said)
    assert (tmp_path / "1f1b.csv").exists() and (tmp_path / "zbh1.png").exists()
