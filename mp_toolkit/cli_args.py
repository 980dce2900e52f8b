"""`mpt`'s flags: the parser of ``mpt train``, ``plan``, ``simulate`` and ``export`` (`build_parser`).

Every ``train`` flag defaults to `UNSET`, so a flag given on the command line (which overrides the
DeepSpeed config) can be told from one left out; `FIELDS` are the flags that are `TrainConfig` fields
(by their flat names: `mp_toolkit.run.config.SECTION_OF`), and each of those takes its help from the
field's docstring in its section (`field_docs`). Nothing here imports
torch: ``mpt --help`` is the parser alone, and each command imports its code when it runs (`mp_toolkit.cli`).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from mp_toolkit.flag_values import (
    BucketError,
    ElasticError,
    RecomputeError,
    SpikeRewindError,
    parse_buckets,
    parse_elastic,
    parse_layer_counts,
    parse_spike_rewind,
)
from mp_toolkit.names import LAMB_RULES, PLAN_METHODS, RECOMPUTE_MODES
from mp_toolkit.names import PRECISIONS as COMPUTE_PRECISIONS
from mp_toolkit.partition.request import PlanRequest
from mp_toolkit.run.config import (
    ENGINES,
    LR_DECAYS,
    OPTIMIZERS,
    PRECISIONS,
    SCHEDULES,
    SECTION_OF,
    SECTIONS,
    TrainConfig,
)

DEPRECATED = "deprecated_flags"
"""Where `_Deprecated` notes the deprecated flags given (removed from the parsed namespace)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit 2) instead of usage + error."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)

    def parse_args(self, args=None, namespace=None):
        """Parse, then say once per deprecated flag given what to write instead (one line each)."""
        parsed = super().parse_args(args, namespace)
        for old, new in vars(parsed).pop(DEPRECATED, {}).items():
            sys.stderr.write(f"{old} is deprecated: use {new}\n")
        return parsed


class _Deprecated(argparse.Action):
    """A flag kept for old command lines: stores its value as its successor does and notes the flag,
    so that `_Parser.parse_args` says once, after a parse that succeeded, what to write instead."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        notes = getattr(namespace, DEPRECATED, {})
        notes[option_string] = "--" + self.dest.replace("_", "-")
        setattr(namespace, DEPRECATED, notes)


def _positive_float_or_none(text: str) -> float | None:
    if text.lower() in ("none", "off", "0"):
        return None
    return float(text)


class _Unset:
    """Default of every `train` flag, so a flag given on the command line (which overrides the
    DeepSpeed config) can be told from one left out."""

    def __repr__(self) -> str:
        return "(default)"


UNSET = _Unset()
RECOMPUTE_CHOICES = (*RECOMPUTE_MODES, "auto")
FIELDS = frozenset(SECTION_OF)


def field_docs() -> dict[str, str]:
    """Each TrainConfig field by its flat name (`SECTION_OF`: the top-level fields and every section's)
    with its docstring, on one line; the help of ``mpt train``'s flags can only say what they say."""
    docs = {}
    for cls in (TrainConfig, *SECTIONS.values()):
        docs.update(class_field_docs(cls))
    return {name: docs[name] for name in SECTION_OF if name in docs}


def class_field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` with a docstring (the string literal under it), on one line.

    Read from the class's source with `ast`, once per parser: cheap and torch-free.
    """
    tree = ast.parse(Path(sys.modules[cls.__module__].__file__).read_text(encoding="utf-8"))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls.__name__).body
    return {node.target.id: " ".join(after.value.value.split())
            for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)}


def flag_help(doc: str, extra: str = "", negates: bool = False) -> str:
    """A field flag's help: its docstring without reST quoting (``x`` and `x` read x), "off: " before
    it for a flag that sets the field False, then ``extra`` (what only the command line has)."""
    text = ("off: " if negates else "") + re.sub(r"`+([^`]*)`+", r"\1", doc) + (f" {extra}" if extra else "")
    return text.replace("%", "%%")  # argparse formats help with %


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpt", description="Pipeline model-parallel training for Transformers.")
    # the deepspeed launcher passes --local_rank=N first; LOCAL_RANK in the environment says the same
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train_parser(sub)
    _add_plan_parser(sub)
    _add_simulate_parser(sub)
    _add_export_parser(sub)
    _add_data_parser(sub)
    return parser


def _add_train_parser(sub) -> None:
    d, docs = TrainConfig().flat(), field_docs()
    t = sub.add_parser("train", help="train a model over a pp x tp x dp grid of ranks")

    def opt(*flags, **kw):
        t.add_argument(*flags, default=UNSET, **kw)

    def field(*flags, extra: str = "", show_default: bool = False, **kw):
        """A flag that sets the TrainConfig field of its dest: help from the field's docstring."""
        action = t.add_argument(*flags, default=UNSET, **kw)
        if show_default:
            extra = f"{extra} (default {d[action.dest]})".lstrip()
        action.help = flag_help(docs[action.dest], extra, negates=kw.get("const") is False)

    opt("--config", "--deepspeed_config", "--deepspeed-config", dest="ds_config", type=Path,
        help="a DeepSpeed JSON config (batch, fp16/bf16, optimizer, scheduler, pipeline); flags given here override it")
    t.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    field("--model", show_default=True)
    field("--hf", metavar="DIR")
    field("--pp", type=int, show_default=True)
    field("--tp", type=int)
    field("--dp", type=int, extra="Under a launcher with --config: world size / (pp x tp), as DeepSpeed computes it.")
    field("--cp", type=int)
    field("--cp-attention", type=str.lower, choices=("ring", "ulysses"))
    field("--sequence-parallel", dest="sequence_parallel", action="store_const", const=True)
    field("--elastic", type=_elastic, metavar="MIN:MAX")
    field("--dp-bucket-mb", type=float)
    field("--zero", type=int)
    field("--schedule", type=str.lower, choices=(*SCHEDULES, "auto"),
          extra="auto: the fastest the planner predicts (FLOP times) that fits (--memory-gb when given). "
                "Not given: with our engine at pp > 1, the one the planner predicts fastest of 1F1B and the "
                "schedules it weighs beside it (1F1B on a tie; a line says which when another).")
    field("--engine", type=str.lower, choices=ENGINES, show_default=True)
    field("--chunks", type=int, extra="Default with --schedule interleaved: 2.")
    field("--partition", show_default=True)
    field("--cluster", metavar="FILE|NAME")
    field("--layout", "--plan", metavar="auto|FILE[:K]")
    field("--global-batch", type=int)
    field("--microbatches", type=int)
    field("--micro-batch", type=int)
    field("--seq-len", type=int)
    field("--length-buckets", type=_buckets, metavar="L[,L...]")
    field("--steps", type=int)
    field("--optimizer", type=str.lower, choices=OPTIMIZERS)
    field("--lr", type=float, extra="Replaces a DeepSpeed config's scheduler by warm-up/decay.")
    field("--weight-decay", type=float)
    field("--betas", type=float, nargs=2, metavar=("BETA1", "BETA2"))
    field("--eps", type=float)
    field("--min-trust", type=float)
    field("--max-trust", type=float)
    field("--no-bias-correction", dest="bias_correction", action="store_const", const=False)
    field("--lamb-rule", type=str.lower, choices=LAMB_RULES)
    field("--momentum", type=float)
    field("--trust-coefficient", type=float)
    field("--warmup-steps", type=int)
    field("--lr-decay", type=str.lower, choices=LR_DECAYS)
    field("--min-lr", type=float)
    field("--precision", type=str.lower, choices=PRECISIONS)
    field("--loss-scale", type=float)
    field("--initial-scale-power", type=int)
    field("--loss-scale-window", type=int)
    field("--hysteresis", type=int)
    field("--consecutive-hysteresis", action="store_const", const=True)
    field("--min-loss-scale", type=float)
    field("--clip-grad", type=_positive_float_or_none, extra="none, off or 0: no clipping.", show_default=True)
    field("--seed", type=int)
    field("--data")
    field("--metrics", type=Path)
    field("--plot", type=Path)
    field("--eval-every", type=int)
    field("--eval-batches", type=int, show_default=True)
    field("--tensorboard", type=Path, metavar="DIR")
    field("--csv", type=Path, metavar="FILE")
    field("--cache-dir", type=Path)
    field("--tokenizer", type=Path, metavar="DIR|FILE")
    field("--data-changed-ok", action="store_const", const=True)
    field("--threads", type=int)
    field("--timeout", dest="timeout_s", type=float, metavar="SECONDS")
    field("--hang-timeout", dest="hang_timeout_s", type=float, metavar="SECONDS", show_default=True)
    field("--no-progress", dest="progress", action="store_const", const=False)
    field("--save-dir", type=Path)
    field("--save-every", type=int)
    field("--overwrite", action="store_const", const=True)
    field("--keep", type=int, extra="0 keeps all.", show_default=True)
    field("--resume", nargs="?", const="latest", metavar="DIR|latest|auto", extra="Without a value: latest.")
    field("--restarts", type=int)
    field("--max-skips", type=int, show_default=True)
    field("--check-replicas", type=int, metavar="N")
    field("--spike-rewind", type=_spike_rewind, metavar="Z,K[,R]")
    field("--async-save", action="store_const", const=True)
    field("--recompute", type=str.lower, choices=RECOMPUTE_CHOICES)
    field("--recompute-layers", type=_layer_counts, metavar="N[,N...]")
    field("--memory-gb", type=float)
    opt("--dry-run", action="store_true", help="run every check, print the run and mpt plan's prediction for its "
                                               "cut, start nothing (exit 0), also under a launcher")


def _add_plan_parser(sub) -> None:
    d = PlanRequest(model="")
    p = sub.add_parser("plan", help="cut a model into stages and predict time, memory and bubble")
    p.add_argument("--model", required=True, help="preset or HuggingFace config.json (GPT-2, BERT, Llama families)")
    for name in ("pp", "tp", "dp"):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name))
    p.add_argument("--cp", type=int, default=d.cp, help="context-parallel ranks: each holds seq / cp of every "
                   "sequence (mpt train --cp; GPT-2 and Llama families)")
    p.add_argument("--cp-attention", type=str.lower, default=d.cp_attention, choices=("ring", "ulysses"),
                   help="how the cp ranks attend (mpt train --cp-attention)")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per micro-batch")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="micro-batches per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--method", default=d.method, help=", ".join(PLAN_METHODS))
    p.add_argument("--memory-gb", type=float, default=None, help="per-device memory cap")
    p.add_argument("--precision", default=d.precision, type=str.lower, choices=COMPUTE_PRECISIONS,
                   help="what the stages compute and communicate in (mpt train --precision)")
    p.add_argument("--dtype", dest="precision", type=str.lower, choices=COMPUTE_PRECISIONS,
                   action=_Deprecated, help=argparse.SUPPRESS)
    p.add_argument("--optimizer", default=d.optimizer, type=str.lower, choices=OPTIMIZERS)
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD / LARS / RMSprop momentum (default: the "
                   "optimizer's own; SGD's buffer is kept only when it is not 0)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help=f"weight decay (default "
                   f"{d.weight_decay}; SGD's and RMSprop's steps make a temporary only when it is not 0)")
    p.add_argument("--zero", type=int, default=d.zero, help="ZeRO stage 0 or 1: optimizer state and fp32 masters "
                   "partitioned over the dp replicas (static bytes per parameter)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (tp > 1): norms, "
                   "dropout masks and stage messages hold seq / tp of the tokens (mpt train --sequence-parallel)")
    p.add_argument("--schedule", default=d.schedule, type=str.lower, choices=(*SCHEDULES, "auto"),
                   help="auto: the fastest predicted schedule that fits --memory-gb")
    p.add_argument("--chunks", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    p.add_argument("--tflops", type=float, default=None,
                   help="device TFLOP/s for FLOP-based times (default: measured here)")
    p.add_argument("--measure", action="store_true", help="time every layer here whatever the method")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank while timing layers "
                   "(default: as mpt train picks them)")
    p.add_argument("--no-load", dest="load", action="store_false",
                   help="time layers on an idle machine, without stand-ins for the other ranks")
    p.add_argument("--p2p-latency-us", type=float, default=d.p2p_latency_us)
    p.add_argument("--p2p-gbps", type=float, default=d.p2p_gbps, help="p2p and collective bandwidth, GB/s")
    p.add_argument("--mem-gbps", type=float, default=d.mem_gbps,
                   help="memory bandwidth for the optimizer step estimate")
    p.add_argument("--hf", action="store_true", help="--model is a HuggingFace config trained from transformers' "
                   "modules (mpt train --hf): count what they keep")
    p.add_argument("--json", type=Path, default=None, help="write the plan as JSON")
    p.add_argument("--gantt", type=Path, default=None, help="draw the predicted schedule (.png or .svg)")
    p.add_argument("--recompute", default=d.recompute, type=str.lower, choices=RECOMPUTE_CHOICES,
                   help="none, full, selective, or auto (with --method memory: chosen per stage with the cut)")
    p.add_argument("--recompute-layers", type=_layer_counts, default=None, metavar="N[,N...]",
                   help="first N block layers of every stage, or one count per stage (default: all)")
    g = p.add_argument_group("device profile and layout search (issue 36)")
    g.add_argument("--cluster", default=None, metavar="FILE|NAME",
                   help="device and cluster profile (JSON / YAML, or a shipped one: h100-sxm, h200-sxm, "
                        "a100-sxm-80gb, l4): FLOP rates, links, memory; replaces --tflops, --p2p-*, --mem-gbps")
    g.add_argument("--profile-here", type=Path, default=None, metavar="OUT",
                   help="measure this machine (matmul rates at --model's shapes, gloo links, memory) into OUT")
    g.add_argument("--calibrate", action="store_true",
                   help="with --profile-here: fit the step's closing collectives, the tensor-parallel "
                        "all-reduce latency and the heap beyond the planned tensors to five short mpt train "
                        "runs of --model (pp 2, tp 2, one rank; ~40 s)")
    g.add_argument("--search", action="store_true",
                   help="search every layout for --devices and --global-batch (ignores --pp --tp --dp "
                        "--micro-batch --microbatches --schedule --recompute --zero)")
    g.add_argument("--devices", type=int, default=None, help="devices to lay the run out on (--search)")
    g.add_argument("--global-batch", type=int, default=None, help="sequences per step over all replicas (--search)")
    g.add_argument("--top", type=int, default=5, help="layouts to print (--search; default 5)")
    g.add_argument("--no-context-parallel", dest="search_cp", action="store_false",
                   help="search cp 1 only (--search; default: cp too, for GPT-2 and Llama families)")
    g.add_argument("--no-sequence-parallel", dest="search_sp", action="store_false",
                   help="lay tp > 1 out without sequence parallelism (--search; default: with it wherever "
                        "--seq-len splits over tp)")
    g.add_argument("--max-micro-batch", type=int, default=None,
                   help="largest micro-batch size to try (--search; default any divisor of the batch per replica)")


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return parse_buckets(text)
    except BucketError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _layer_counts(text: str) -> tuple[int, ...]:
    try:
        return parse_layer_counts(text)
    except RecomputeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _elastic(text: str) -> tuple[int, int]:
    try:
        return parse_elastic(text)
    except ElasticError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _spike_rewind(text: str) -> tuple[float, int, int] | None:
    try:
        return parse_spike_rewind(text)
    except SpikeRewindError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a schedule with unit or given costs")
    p.add_argument("--schedule", required=True, type=str.lower, choices=SCHEDULES)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--chunks", type=int, default=None,
                   help="model chunks per rank (interleaved; default 2; the V schedules hold 2)")
    for kind, default in (("f", 1.0), ("b", 2.0)):
        p.add_argument(f"--cost-{kind}", type=float, default=default, help=f"{kind.upper()} cost of one micro-batch")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--gantt", type=Path, default=None, help=".png or .svg")
    p.add_argument("--print", action="store_true", dest="print_grid",
                   help="also print the ranks x time-steps grid of the schedule's compute actions (unit costs)")




def _add_export_parser(sub) -> None:
    e = sub.add_parser("export", help="write a HuggingFace model directory (from_pretrained) from a checkpoint")
    e.add_argument("--checkpoint", required=True, type=Path, help="a --save-dir (its latest) or one step-XXXXXXXX")
    e.add_argument("--out", required=True, type=Path, help="the HF directory to write (new or empty)")
    e.add_argument("--config", type=Path, default=None,
                   help="HF config.json, for a checkpoint of an HF-loaded run whose manifest has no hf_config")
    e.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory or tokenizers JSON to ship (default: the run's own, when it can be found)")
    e.add_argument("--cache-dir", type=Path, default=None, help="the tokenizer cache the run used (mpt train "
                   "--cache-dir; default its default): the run's trained tokenizer is read only from here")
    e.add_argument("--force", action="store_true", help="replace --out when it is not empty")
    e.add_argument("--max-shard-size", default="5GB",
                   help="split the weights into model-0000i-of-0000n.safetensors + index above this size "
                        "(e.g. 5GB, 500MiB; default 5GB); the export streams one layer at a time either way")


def _add_data_parser(sub) -> None:
    """``mpt data prepare / merge / verify`` (`mp_toolkit.data.prepare`); flag names as Megatron-LM's
    tools/preprocess_data.py spells them where it has the flag. Defaults left None are `prepare`'s own."""
    d = sub.add_parser("data", help="prepare a corpus into memory-mapped token shards (Megatron's indexed format)")
    cmd = d.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    p = cmd.add_parser("prepare", help="tokenize input files into DIR (manifest, tokenizer, train/val shards)")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files (.txt .py .md: one document each; .jsonl .json: JSON lines; any of those .gz or .zst; "
                        ".parquet, .arrow), save_to_disk directories, directories searched recursively, or 'stdlib'")
    p.add_argument("--output", required=True, type=Path, metavar="DIR", help="the prepared directory (new, empty, "
                   "or one an interrupted run of the same command left: it continues)")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", type=Path, metavar="DIR|FILE",
                     help="a tokenizer.json, or an HF tokenizer directory holding one (copied into DIR)")
    tok.add_argument("--vocab-size", type=int, metavar="V",
                     help="train our byte-level BPE of V ids on a sample of the corpus (with --split-sentences V "
                          "counts the 4 BERT special tokens)")
    p.add_argument("--workers", type=int, default=None, help="encoding processes (default: the CPU count)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="the JSON field / Parquet or Arrow column that holds the text (default: text)")
    p.add_argument("--split-sentences", action="store_true",
                   help="store each document's sentences as its sequences (BERT); documents are their groups")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=None,
                   help="end each document with the tokenizer's end-of-document id (default: on, unless "
                        "--split-sentences)")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, default=None, metavar="F",
                     help="the share of documents held out for validation, chosen by a hash (default 0)")
    val.add_argument("--val-docs", type=int, default=None, metavar="K",
                     help="hold out exactly K documents (one extra reading pass over the corpus)")
    p.add_argument("--val-min-docs", type=int, default=None, metavar="M",
                   help="with --val-fraction: at least M documents held out, the M of smallest hash, when the "
                        "fraction gives fewer (one extra reading pass)")
    p.add_argument("--seed", type=int, default=None, help="seeds the validation choice and the tokenizer's sample "
                   "(default 0)")
    p.add_argument("--tokenizer-sample-bytes", type=int, default=None, metavar="B",
                   help="bytes of whole documents the tokenizer trains on (default 64,000,000)")
    p.add_argument("--chunk-docs", type=int, default=None, metavar="C",
                   help="documents per shard of an input file, the unit a re-run skips (default 100,000)")
    p.add_argument("--shard", default=None, metavar="i/n",
                   help="prepare only input files k with k %% n == i (needs --tokenizer); then `mpt data merge DIR`")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = cmd.add_parser("merge", help="join the manifest parts of `prepare --shard i/n` runs into DIR/manifest.json")
    m.add_argument("dir", type=Path, metavar="DIR")
    v = cmd.add_parser("verify", help="check every shard's index and every file's sha256 against DIR's manifest")
    v.add_argument("dir", type=Path, metavar="DIR")
