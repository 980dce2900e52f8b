"""The command line before any command runs: the parser imports no torch, the help of `mpt train`'s
field flags is the fields' own documentation, `--dtype` says once that it is `--precision` now, and
one list names the schedules."""

import argparse
import subprocess
import sys

import pytest

from mp_toolkit.cli_args import FIELDS, build_parser, field_docs, flag_help
from mp_toolkit.names import SCHEDULE_TITLES, SCHEDULES, schedule_name
from mp_toolkit.partition.auto_schedule import CANDIDATES
from mp_toolkit.partition.request import PlanRequest
from mp_toolkit.run.config import SECTION_OF
from mp_toolkit.schedule import GENERATORS, get_schedule

HEAVY = ("torch", "numpy", "datasets", "transformers")


def command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_the_parser_and_help_import_no_torch():
    """A fresh interpreter builds the parser, parses a train line and prints `mpt train --help`
    (exit 0) without importing torch, numpy, datasets or transformers."""
    code = ("import sys\n"
            "from mp_toolkit.cli import main\n"
            "from mp_toolkit.cli_args import build_parser\n"
            "build_parser().parse_args(['train', '--pp', '2', '--length-buckets', '32,64', "
            "'--recompute-layers', '1'])\n"
            "try:\n"
            "    main(['train', '--help'])\n"
            "except SystemExit as e:\n"
            "    code = e.code\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "print('HEAVY', heavy, 'EXIT', code, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "HEAVY [] EXIT 0", r.stderr
    assert "--precision {fp32,fp16,bf16,auto}" in r.stdout and "Pipeline stages" in r.stdout


def test_mpt_train_help_exits_0():
    r = subprocess.run([sys.executable, "-m", "mp_toolkit.cli", "train", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("usage: mpt train")


def test_field_docs_read_every_field_and_its_docstring():
    docs = field_docs()
    assert set(docs) == set(SECTION_OF)  # every flat field: the top-level ones and each section's
    assert docs["pp"] == "Pipeline stages (ranks along the slowest grid axis)."
    assert docs["microbatches"] == ("Micro-batches per global batch on each data-parallel replica (= gradient "
                                    "accumulation steps); the global batch is dp x microbatches x micro_batch "
                                    "sequences.")


def test_every_field_flag_takes_its_help_from_the_field_docstring():
    docs = field_docs()
    train = command("train")
    flags = [a for a in train._actions if a.dest in FIELDS]
    assert {a.dest for a in flags} == FIELDS - {"lr_schedule", "wandb"}  # those two come from a DeepSpeed config
    for action in flags:
        negates = action.const is False
        derived = flag_help(docs[action.dest], negates=negates)
        assert docs[action.dest] and action.help.startswith(derived), (action.option_strings, action.help)
        assert train.format_help()  # every help formats (a % in a docstring is escaped)
    assert command("train")._option_string_actions["--no-progress"].help == "off: Show a progress bar on rank 0."
    keep = command("train")._option_string_actions["--keep"].help
    assert keep.endswith("None keeps every one. 0 keeps all. (default 3)"), keep


def test_flag_help_drops_rest_quoting_and_escapes_percent():
    assert flag_help("``a`` and `b.c` at 50%", "extra") == "a and b.c at 50%% extra"


@pytest.mark.parametrize("given", [["--dtype", "BF16"], ["--dtype", "fp16", "--dtype", "bf16"]])
def test_dtype_is_a_deprecated_precision_said_once(capsys, given):
    args = build_parser().parse_args(["plan", "--model", "gpt-tiny", *given])
    assert args.precision == given[-1].lower() and not hasattr(args, "dtype")
    assert capsys.readouterr().err == "--dtype is deprecated: use --precision\n"


def test_precision_says_nothing(capsys):
    args = build_parser().parse_args(["plan", "--model", "gpt-tiny", "--precision", "bf16"])
    assert args.precision == "bf16" and capsys.readouterr().err == ""
    assert build_parser().parse_args(["plan", "--model", "gpt-tiny"]).precision == PlanRequest(model="").precision


def test_one_list_of_schedule_names():
    assert tuple(GENERATORS) == SCHEDULES == CANDIDATES
    for flag_owner in (command("train"), command("plan")):
        assert flag_owner._option_string_actions["--schedule"].choices == (*SCHEDULES, "auto")
    assert command("simulate")._option_string_actions["--schedule"].choices == SCHEDULES
    for name, title in SCHEDULE_TITLES.items():
        assert schedule_name(title) == schedule_name(title.upper()) == schedule_name(name) == name
        assert get_schedule(title, 2, 4).name == title
    assert schedule_name("zb-h1") == "zbh1" and schedule_name("zb-drain") == "zbdrain"
    assert schedule_name("pipedream") is None
