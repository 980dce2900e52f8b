"""The data path against the corpus size: per-rank memory of ``mpt train --data DIR``, the data set-up
before the first step, and ``mpt data prepare``'s throughput against the tokenizers library's own
``encode_batch`` on as many processes.

Everything runs on corpora generated here (`write_corpus`: seeded JSON lines, 30% of the documents
source-code-like lines, 70% English-like paragraphs of Zipf-distributed pseudo-words, lengths drawn
from a log-normal, written as a stream) and on tokenizers trained here with the ``tokenizers`` library:
a GPT-2-style byte-level BPE of 32,000 ids, a BERT WordPiece of up to 30,000 ids ([PAD] [UNK] [CLS]
[SEP] [MASK]) and a byte-level BPE of 4,096 ids, gpt-small-cpu's vocabulary, which the corpora trained
on are prepared with. Nothing is downloaded. All of it lives under one temporary directory, removed at
the end, on an error or on SIGTERM / SIGHUP too.

1. **Memory**: ``mpt train --model gpt-small-cpu --pp 2 --data DIR --steps 1 --threads 1 --no-progress
   --cache-dir TMP`` on the prepared small and large corpus: each rank's peak resident memory from
   process start (`mpt train`'s metrics row, ``peak_rss_bytes``), at the first start (rank 0 builds the
   sample index) and at a second start (the index cached); ``--data synthetic`` is the reference.
   Goal: the cached start within 5% or 30 MiB between the sizes.
2. **Set-up time**: ``feed(DIR, ...)`` plus the first micro-batch (`mp_toolkit.data.feed`,
   `mp_toolkit.data.lm.MicroBatches`), in this process, with the sample index cached and built anew
   (the data files in the page cache both times); and each train run's time from launch to its first
   step. Goal: under 2 s at every size.
3. **Prepare throughput**: ``mpt data prepare --workers N`` (``--split-sentences`` for WordPiece) against
   the limit: N ``python -c`` processes, each reading its byte range of the same JSON lines and calling
   ``Tokenizer.encode_batch`` on 256 documents at a time (prepare's batch), one thread per process
   (``TOKENIZERS_PARALLELISM=false``) in both. Per worker, MB/s from launch to the last exit (and by
   prepare's own clock, which leaves out its interpreter start and imports), and MB per CPU second of
   every process of each (user + system, sampled from /proc: what other load on the machine does not
   change); prepare / limit of each (goal >= 0.8). WordPiece has a second limit, whose processes encode the
   sentences prepare cuts (its `encode.SENTENCE_END`, 256 documents' sentences a call), to tell the cost of
   encoding sentences rather than documents from prepare's own. A larger size is compared with the limit measured at
   the small one (the limit streams: its rate does not depend on the size). Prepare's peak RSS (its
   process, and its largest worker, sampled from /proc 20 times a second) at every size, with the
   4,096-id BPE: the preparation the training runs need. Goal: not growing with the corpus.

    python -m tools.bench_data                              # 50 MB and 2 GB: 13-20 minutes on 2 shared cores
    python -m tools.bench_data --sizes-mb 50,500            # 5-8 minutes on 2 shared cores
    python -m tools.bench_data --sizes-mb 50                # the small size alone: nothing to compare
    python -m tools.bench_data --sizes-mb 1,2 --quick       # seconds: no mpt train, no 32k BPE, 1k WordPiece
    python -m tools.bench_data --memory-only                # parts 1 and 2 at 50 MB and 2 GB, in minutes

``--memory-only`` prepares the small corpus alone and makes the large one from it: its training shards
linked ``ceil(large / small)`` times under other names, one manifest listing them all (`replicate`),
the tokens a prepare of the large corpus would give, in number and in shard layout, minus the
encoding. Parts 1 and 2 then run on both; part 3 does not.

Prints the machine header (`tools.report`), three tables and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from mp_toolkit.data.encode import SENTENCE_END
from mp_toolkit.data.feed import Wanted, feed
from mp_toolkit.data.lm import MicroBatches
from tools.ranks import ROOT, RunError, mpt_argv
from tools.report import header, json_line

MB, MIB = 1e6, 2**20
MODEL = "gpt-small-cpu"
WANTED = Wanted(vocab_size=4096, seq_len=128, seed=0)
"""gpt-small-cpu as `mpt train` runs it (vocabulary 4096, --seq-len 128, seed 0)."""
MICRO_BATCH, GLOBAL_BATCH = 8, 32  # mpt train's defaults: 4 micro-batches of 8
ONE_THREAD = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
SPECIALS_BERT = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
EOT = "<|endoftext|>"
TRAIN_TOKENIZER = "bpe-4k"
"""The tokenizer the corpora `mpt train` reads are prepared with (gpt-small-cpu's 4096 ids)."""
SAMPLE_HZ = 20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
BATCH_DOCS = 256
"""Documents per encode_batch call of a limit process: what `mpt data prepare` hands a worker at a time."""

# ---- the corpus -----------------------------------------------------------------------------------------------

SYLLABLES = ("ka", "lo", "mi", "ne", "ra", "to", "su", "vi", "der", "ion", "ter", "al", "en", "st", "pro", "con",
             "ble", "ing", "ed", "ment", "th", "qu", "ar", "or", "an", "is", "re", "un", "ly", "ous", "é", "ß")


class CorpusWriter:
    """Seeded documents like text and source code: pools of sentences and code lines built from a
    Zipf-distributed vocabulary of pseudo-words, documents drawn from the pools (held: the pools only)."""

    def __init__(self, seed: int, words: int = 20_000, pool: int = 40_000):
        self.rng = rng = random.Random(seed)
        vocab = set()
        while len(vocab) < words:
            vocab.add("".join(rng.choice(SYLLABLES) for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4)))))
        vocab = sorted(vocab)
        rng.shuffle(vocab)  # rank in the Zipf law is random, not alphabetical
        zipf = list(itertools.accumulate(1.0 / (r + 1) ** 1.07 for r in range(words)))  # cumulative: O(log V) a draw
        self.sentences = [self._sentence(rng.choices(vocab, cum_weights=zipf, k=rng.randint(4, 28)))
                          for _ in range(pool)]
        self.code = [self._code_line(*rng.choices(vocab, cum_weights=zipf, k=3)) for _ in range(pool)]

    def _sentence(self, ws: list[str]) -> str:
        rng = self.rng
        ws[0] = ws[0].capitalize()  # `prepare.SENTENCE_END` splits before a capital
        for i in range(1, len(ws) - 1):
            u = rng.random()
            ws[i] += "," if u < 0.06 else ""
            ws[i] = str(rng.randint(0, 2030)) if 0.06 <= u < 0.08 else ws[i]
        return " ".join(ws) + rng.choice(".....!?")

    def _code_line(self, a: str, b: str, c: str) -> str:
        rng = self.rng
        forms = (f"def {a}_{b}({c}, {a}=None):", f"return {a}.{b}({c}) + {rng.randint(0, 99)}",
                 f"for {a} in range(len({b}_{c})):", f"if {a} is not None and {b} > {rng.random():.3f}:",
                 f"{a}_{b} = {{'{c}': {rng.randint(0, 9999)}, '{a}': [{b}, {c}]}}", f"# {a} {b} {c}: TODO {c}",
                 f"self.{a} = {b}[{c}:{rng.randint(1, 64)}]", f'raise ValueError(f"{a} {{{b}!r}} is not {c}")')
        return "    " * rng.randint(0, 3) + rng.choice(forms)

    def document(self) -> str:
        rng = self.rng
        units = min(4000, max(2, int(rng.lognormvariate(3.0, 1.0))))  # median 20 lines / sentences, a long tail
        if rng.random() < 0.3:
            return "\n".join(rng.choices(self.code, k=units))
        paragraphs = []
        while units > 0:
            k = min(units, rng.randint(2, 8))
            paragraphs.append(" ".join(rng.choices(self.sentences, k=k)))
            units -= k
        return "\n\n".join(paragraphs)


def write_corpus(path: Path, megabytes: float, writer: CorpusWriter) -> dict:
    """JSON lines of ``writer``'s documents until ``megabytes`` MB are written; their bytes and count."""
    target, written, documents = int(megabytes * MB), 0, 0
    with open(path, "wb") as f:
        while written < target:
            line = (json.dumps({"text": writer.document()}, ensure_ascii=False) + "\n").encode()
            f.write(line)
            written, documents = written + len(line), documents + 1
    return {"path": str(path), "bytes": written, "documents": documents}


def texts(path: Path, megabytes: float):
    """The first ``megabytes`` MB of documents of a JSON-lines corpus."""
    read = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if read >= megabytes * MB:
                return
            read += len(line)
            yield json.loads(line)["text"]


# ---- tokenizers, built here ----------------------------------------------------------------------------------


def byte_level_bpe(sample: Path, megabytes: float, vocab: int) -> Tokenizer:
    """GPT-2's shape: byte-level pre-tokenizer (its regex), BPE, <|endoftext|>, byte-level decoder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(sample, megabytes), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def wordpiece(sample: Path, megabytes: float, vocab: int) -> Tokenizer:
    """BERT's shape: lower-casing BERT normalizer and pre-tokenizer, WordPiece, [CLS] A [SEP] B [SEP]."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(texts(sample, megabytes), trainers.WordPieceTrainer(
        vocab_size=vocab, special_tokens=SPECIALS_BERT, show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


@dataclass(frozen=True)
class Tok:
    """A tokenizer as this benchmark uses it: its name, file, whether prepare splits sentences with it."""

    name: str
    file: Path
    vocab: int
    split_sentences: bool = False


def build_tokenizers(sample: Path, out: Path, quick: bool) -> dict[str, Tok]:
    """The three tokenizers (module docstring), trained on the sample's first 8 MB; --quick: a 1,000-id
    WordPiece and the 4,096-id BPE on 0.5 MB (the 32,000-id BPE is the 4,096-id one's code at another size)."""
    mb = 0.5 if quick else 8.0
    built = {} if quick else {"bpe-32k": (byte_level_bpe, 32_000, False)}
    built.update({"wordpiece-30k": (wordpiece, 1000 if quick else 30_000, True),
                  TRAIN_TOKENIZER: (byte_level_bpe, WANTED.vocab_size, False)})
    out.mkdir(parents=True, exist_ok=True)
    toks = {}
    for name, (make, vocab, split) in built.items():
        tok = make(sample, mb, vocab)
        tok.save(str(out / f"{name}.json"))
        toks[name] = Tok(name, out / f"{name}.json", tok.get_vocab_size(), split)
    return toks


# ---- processes, measured --------------------------------------------------------------------------------------


@dataclass
class Measured:
    """Finished processes (and their descendants), sampled `SAMPLE_HZ` times a second from /proc while
    they ran: wall seconds from launch to the last exit, each one's output, each one's peak resident set
    size (VmHWM, bytes), the largest descendant's, and the CPU seconds (user + system) of them all."""

    wall_s: float
    outputs: list[str]
    peak_rss: list[int]
    child_peak_rss: int
    cpu_s: float
    root_cpu_s: float
    processes: int


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (/proc/PID/task/TID/children, recursively)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def _sample(pid: int) -> tuple[int, float]:
    """(``pid``'s peak RSS so far in bytes, its CPU seconds so far); (0, 0) when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            hwm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state is fields[0]
        return hwm, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return 0, 0.0


def run_measured(argvs: list[list[str]], logs: list[Path], timeout_s: float = 3600.0) -> Measured:
    """Start every command of ``argvs`` at once (output to its log, one thread each: `ONE_THREAD`) and
    sample them until the last exits. RunError with a log's tail when one fails or at the timeout; every
    process is killed with its session on the way out."""
    start = time.perf_counter()
    procs = []
    try:
        for argv, log in zip(argvs, logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                              start_new_session=True, env={**os.environ, **ONE_THREAD}))
        peaks: dict[int, int] = {}
        cpu: dict[int, float] = {}
        while any(p.poll() is None for p in procs):
            for pid in [q for p in procs for q in (p.pid, *_children(p.pid))]:
                hwm, seconds = _sample(pid)
                peaks[pid], cpu[pid] = max(peaks.get(pid, 0), hwm), max(cpu.get(pid, 0.0), seconds)
            if time.perf_counter() - start > timeout_s:
                raise RunError(f"{' '.join(argvs[0][:6])} ...: timed out after {timeout_s:.0f} s")
            time.sleep(1 / SAMPLE_HZ)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    wall = time.perf_counter() - start
    texts = [log.read_text(errors="replace") for log in logs]
    for p, argv, text in zip(procs, argvs, texts):
        if p.returncode != 0:
            raise RunError(f"{' '.join(argv[:6])} ... exited with {p.returncode}:\n{text[-2000:]}")
    roots = {p.pid for p in procs}
    kids = [v for k, v in peaks.items() if k not in roots]
    return Measured(wall, texts, [peaks.get(p.pid, 0) for p in procs], max(kids, default=0), sum(cpu.values()),
                    sum(cpu.get(pid, 0.0) for pid in roots), len(peaks))


# ---- 3. prepare against the limit ----------------------------------------------------------------------------

LIMIT_WORKER = r"""
import json, re, sys
from tokenizers import Tokenizer
path, tok_file, lo, hi, batch, end = *sys.argv[1:3], *map(int, sys.argv[3:6]), sys.argv[6]
tok = Tokenizer.from_file(tok_file)
split = re.compile(end).split if end else None
docs = sequences = tokens = 0
def encode(texts):
    global docs, sequences, tokens
    docs += len(texts)
    if split:  # as mpt data prepare --split-sentences: stripped non-empty lines, each cut at the sentence end
        texts = [s for text in texts for line in text.splitlines() if line.strip() for s in split(line.strip())]
    ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    sequences, tokens = sequences + sum(map(bool, ids)), tokens + sum(map(len, ids))
with open(path, "rb") as f:
    f.seek(lo)
    texts = []
    while f.tell() < hi:
        line = f.readline()
        if line.strip():
            texts.append(json.loads(line)["text"])
        if len(texts) == batch:
            encode(texts)
            texts = []
    encode(texts)
print(json.dumps({"documents": docs, "sequences": sequences, "tokens": tokens}))
"""
"""One limit process: its byte range [lo, hi) of the JSON lines (whole lines), encode_batch on each batch's
documents, or on their sentences when a sentence-end pattern is given; counts printed."""


def line_ranges(path: Path, n: int) -> list[tuple[int, int]]:
    """``n`` byte ranges of ``path`` that cover it, each starting at a line."""
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as f:
        for i in range(1, n):
            f.seek(max(cuts[-1], size * i // n))
            f.readline()
            cuts.append(min(f.tell(), size))
    return list(zip(cuts, cuts[1:] + [size]))


def limit(corpus: Path, tok: Tok, workers: int, tmp: Path, sentences: bool = False) -> dict:
    """N `LIMIT_WORKER` processes at once, from launch to the last exit; documents, sequences, tokens counted.
    ``sentences``: each encodes the sentences prepare --split-sentences cuts (`encode.SENTENCE_END`)."""
    ranges = line_ranges(corpus, workers)
    end = SENTENCE_END.pattern if sentences else ""
    m = run_measured([[sys.executable, "-c", LIMIT_WORKER, str(corpus), str(tok.file), str(lo), str(hi),
                       str(BATCH_DOCS), end] for lo, hi in ranges],
                     [tmp / f"limit-{tok.name}-{i}.log" for i in range(len(ranges))])
    counts = [json.loads(text.strip().splitlines()[-1]) for text in m.outputs]
    return {**rates(corpus, m, workers), **{k: sum(c[k] for c in counts) for k in ("documents", "sequences", "tokens")},
            "peak_rss_mib": max(m.peak_rss) / MIB}


def rates(corpus: Path, m: Measured, workers: int) -> dict:
    """MB/s per worker from launch to exit, and MB per CPU second (of every process: the load's share left out)."""
    mb = corpus.stat().st_size / MB
    return {"seconds": m.wall_s, "mb_s_per_worker": mb / m.wall_s / workers, "cpu_s": m.cpu_s,
            "mb_per_cpu_s": mb / m.cpu_s}


def prepare(corpus: Path, tok: Tok, workers: int, out: Path, tmp: Path) -> dict:
    """``mpt data prepare`` of ``corpus`` into ``out``, measured (wall, its own clock, peak RSS)."""
    argv = mpt_argv("data", "prepare", "--input", str(corpus), "--output", str(out), "--tokenizer", str(tok.file),
                    "--workers", str(workers), "--val-fraction", "0.01", "--no-progress",
                    *(["--split-sentences"] if tok.split_sentences else []))
    m = run_measured([argv], [tmp / f"prepare-{out.name}.log"])
    manifest = json.loads((out / "manifest.json").read_text())
    own_s = float(m.outputs[0].rsplit(" MB in, ", 1)[1].split(" s,", 1)[0])  # PrepareSummary.line's seconds
    totals = manifest["totals"]
    return {**rates(corpus, m, workers), "own_seconds": own_s,
            "own_mb_s_per_worker": corpus.stat().st_size / MB / own_s / workers,
            "documents": sum(t["documents"] for t in totals.values()),
            "sequences": sum(t["sequences"] for t in totals.values()),
            "tokens": sum(t["tokens"] for t in totals.values()), "shards": len(manifest["splits"]["train"]),
            "peak_rss_mib": m.peak_rss[0] / MIB, "worker_peak_rss_mib": m.child_peak_rss / MIB,
            "main_cpu_s": m.root_cpu_s, "processes": m.processes}


# ---- 1. and 2. memory and set-up of mpt train --data ----------------------------------------------------------


def train(data: str, tmp: Path, tag: str) -> dict:
    """``mpt train`` (module docstring, 1.): peak RSS per rank from its metrics; launch -> first step."""
    metrics = tmp / f"metrics-{tag}.jsonl"
    launched = time.time()
    m = run_measured([mpt_argv("train", "--model", MODEL, "--pp", "2", "--data", data, "--steps", "1", "--threads",
                               "1", "--no-progress", "--cache-dir", str(tmp / "cache"), "--metrics", str(metrics))],
                     [tmp / f"train-{tag}.log"], timeout_s=1800)
    row = json.loads(metrics.read_text().splitlines()[-1])
    return {"peak_rss_mib": [b / MIB for b in row["peak_rss_bytes"]],
            "peak_load_rss_mib": [b / MIB for b in row["peak_load_rss_bytes"]],
            "launch_to_first_step_s": row["time"] - row["step_time_s"] - launched, "wall_s": m.wall_s,
            "schedule": next((line for line in m.outputs[0].splitlines() if line.startswith("model ")), "")}


def setup_seconds(prepared: Path, cache: Path, cached: bool) -> float:
    """``feed`` of the prepared directory and the first micro-batch, in this process (module docstring, 2.)."""
    if not cached:
        shutil.rmtree(prepared / "cache", ignore_errors=True)  # where feed caches the index of a writable DIR
    start = time.perf_counter()
    fed = feed(str(prepared), WANTED, cache, total=GLOBAL_BATCH)
    batches = MicroBatches(fed.train, MICRO_BATCH, seed=WANTED.seed, validation=fed.validation, digest=fed.digest)
    next(batches)
    return time.perf_counter() - start


def within(a: float, b: float, share: float = 0.05, absolute: float = 30.0) -> bool:
    return abs(a - b) <= max(share * min(a, b), absolute)


# ---- the run --------------------------------------------------------------------------------------------------


def _stop(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through the temporary directory's cleanup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="50,2000",
                    help="the small and the large corpus, MB of JSON lines; one size skips the large")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="prepare's --workers, and the limit's")
    ap.add_argument("--repeats", type=int, default=3, help="set-up timings per size and state (min and median)")
    ap.add_argument("--quick", action="store_true",
                    help="seconds: no mpt train runs (parts 2 and 3 only), no 32,000-id BPE, a 1,000-id WordPiece")
    ap.add_argument("--tmp-dir", default=None, help="where the temporary directory goes (default: the system's)")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON line here")
    ap.add_argument("--memory-only", action="store_true",
                    help="parts 1 and 2 only, the large corpus made of the small one's shards (module docstring)")
    args = ap.parse_args()
    try:
        sizes = [float(s) for s in args.sizes_mb.split(",")]
    except ValueError:
        sizes = []
    if not 1 <= len(sizes) <= 2 or sizes[0] <= 0 or sizes != sorted(set(sizes)):
        ap.error(f"--sizes-mb {args.sizes_mb}: give one size or two, small then large, in MB (e.g. 50,2000)")
    head = header("bench_data")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    with tempfile.TemporaryDirectory(prefix="bench_data_", dir=args.tmp_dir) as d:
        result = (measure_memory if args.memory_only else measure)(Path(d), sizes, args)
    print_tables(result, args.workers)
    json_line("bench_data", head, args.json, sizes_mb=sizes, workers=args.workers, quick=args.quick, **result)


def log(line: str) -> None:
    print(line, flush=True)


def measure(tmp: Path, sizes: list[float], args) -> dict:
    """Parts 3, 2 and 1 of the module docstring, in that order (1 needs what 3 prepares)."""
    labels = [f"{s:g} MB" for s in sizes]
    writer = CorpusWriter(seed=0, words=2_000 if args.quick else 20_000, pool=4_000 if args.quick else 40_000)
    corpora = []
    for i, size in enumerate(sizes):  # the large corpus continues the small one's stream of documents
        corpora.append(write_corpus(tmp / f"corpus-{i}.jsonl", size, writer))
        log(f"corpus {labels[i]}: {corpora[-1]['documents']:,} documents")
    paths = [Path(c["path"]) for c in corpora]
    toks = build_tokenizers(paths[0], tmp / "tokenizers", args.quick)
    log("tokenizers: " + ", ".join(f"{t.name} {t.vocab:,} ids" for t in toks.values()))

    throughput = []  # 3.: each tokenizer at the small size, against its limit; the training tokenizer at every size
    for name, tok in toks.items():
        for i in range(len(sizes)) if name == TRAIN_TOKENIZER else [0]:
            row = {"tokenizer": name, "vocab": tok.vocab, "split_sentences": tok.split_sentences,
                   "size": labels[i], "mb": corpora[i]["bytes"] / MB,
                   "prepare": prepare(paths[i], tok, args.workers, tmp / f"prepared-{name}-{i}", tmp)}
            if i == 0:  # the limit streams: its rate at the small size holds at the large (its start is 0.1 s)
                row["limit"] = lim = limit(paths[i], tok, args.workers, tmp)
                if tok.split_sentences:
                    row["limit_sentences"] = limit(paths[i], tok, args.workers, tmp, sentences=True)
            row.update(limit_size=labels[0], **ratios(row["prepare"], lim))
            if "limit_sentences" in row:
                row.update({f"{k}_sentences": v for k, v in ratios(row["prepare"], row["limit_sentences"]).items()})
            throughput.append(row)
            log(f"prepare {name} {labels[i]}: {row['prepare']['mb_s_per_worker']:.2f} MB/s per worker"
                + (f", limit {row['limit']['mb_s_per_worker']:.2f}" if i == 0 else ""))
    prepared = [tmp / f"prepared-{TRAIN_TOKENIZER}-{i}" for i in range(len(sizes))]

    setup = []  # 2.
    for label, dir_ in zip(labels, prepared):
        for cached in (False, True):
            times = [setup_seconds(dir_, tmp / "cache", cached) for _ in range(args.repeats)]
            setup.append({"size": label, "index": "cached" if cached else "built", "seconds": times,
                          "min_s": min(times), "median_s": statistics.median(times)})

    memory = []  # 1.
    if not args.quick:
        memory.append({"data": "synthetic", "start": "first", **train("synthetic", tmp, "synthetic")})
        for i, (label, dir_) in enumerate(zip(labels, prepared)):
            shutil.rmtree(dir_ / "cache", ignore_errors=True)  # the first start builds the sample index
            for start in ("first", "cached"):
                memory.append({"data": label, "start": start, **train(str(dir_), tmp, f"{i}-{start}")})
                log(f"mpt train {label} ({start} start): peak RSS "
                    + ", ".join(f"{b:.0f}" for b in memory[-1]["peak_rss_mib"]) + " MiB")
    tokens = {r["size"]: r["prepare"]["tokens"] for r in throughput if r["tokenizer"] == TRAIN_TOKENIZER}
    return {"corpora": [{**c, "size": label, f"tokens_{TRAIN_TOKENIZER}": tokens[label]}
                        for c, label in zip(corpora, labels)],
            "tokenizers": {t.name: t.vocab for t in toks.values()}, "memory": memory, "setup": setup,
            "prepare": throughput, "goals": goals(memory, setup, throughput)}


def replicate(small: Path, out: Path, copies: int) -> Path:
    """A prepared directory whose training split is ``small``'s shards ``copies`` times over (hard links
    under other names; the validation split once), with its manifest and tokenizer."""
    doc = json.loads((small / "manifest.json").read_text())
    (out / "train").mkdir(parents=True)
    shutil.copytree(small / "val", out / "val")
    shutil.copy(small / "tokenizer.json", out / "tokenizer.json")
    train = []
    for c in range(copies):
        for shard in doc["splits"]["train"]:
            name = f"train/r{c:04d}-{Path(shard['prefix']).name}"
            for suffix in (".bin", ".idx"):
                os.link(small / (shard["prefix"] + suffix), out / (name + suffix))
            train.append({**shard, "prefix": name})
    doc["splits"]["train"] = train
    doc["totals"]["train"] = {k: v * copies for k, v in doc["totals"]["train"].items()}
    (out / "manifest.json").write_text(json.dumps(doc))
    return out


def measure_memory(tmp: Path, sizes: list[float], args) -> dict:
    """``--memory-only``: parts 1 and 2 on the small corpus prepared and the large one replicated from it."""
    if len(sizes) != 2:
        raise SystemExit("--memory-only needs two sizes (e.g. --sizes-mb 50,2000)")
    labels = [f"{s:g} MB" for s in sizes]
    writer = CorpusWriter(seed=0, words=20_000, pool=40_000)
    corpus = write_corpus(tmp / "corpus-0.jsonl", sizes[0], writer)
    tok = build_tokenizers(Path(corpus["path"]), tmp / "tokenizers", quick=True)[TRAIN_TOKENIZER]
    small = tmp / "prepared-small"
    prepare(Path(corpus["path"]), tok, args.workers, small, tmp)
    copies = math.ceil(sizes[1] / sizes[0])
    large = replicate(small, tmp / "prepared-large", copies)
    log(f"corpus {labels[0]}: {corpus['documents']:,} documents prepared; {labels[1]}: its shards x {copies}")
    setup = []
    for label, dir_ in zip(labels, (small, large)):
        for cached in (False, True):
            times = [setup_seconds(dir_, tmp / "cache", cached) for _ in range(args.repeats)]
            setup.append({"size": label, "index": "cached" if cached else "built", "seconds": times,
                          "min_s": min(times), "median_s": statistics.median(times)})
    memory = [{"data": "synthetic", "start": "first", **train("synthetic", tmp, "synthetic")}]
    for i, (label, dir_) in enumerate(zip(labels, (small, large))):
        shutil.rmtree(dir_ / "cache", ignore_errors=True)
        for start in ("first", "cached"):
            memory.append({"data": label, "start": start, **train(str(dir_), tmp, f"{i}-{start}")})
            log(f"mpt train {label} ({start} start): peak RSS "
                + ", ".join(f"{b:.0f}" for b in memory[-1]["peak_rss_mib"]) + " MiB")
    tokens = [json.loads((d / "manifest.json").read_text())["totals"]["train"]["tokens"] for d in (small, large)]
    return {"corpora": [{**corpus, "size": labels[0], f"tokens_{TRAIN_TOKENIZER}": tokens[0]},
                        {"size": labels[1], "bytes": corpus["bytes"] * copies,
                         "documents": corpus["documents"] * copies, f"tokens_{TRAIN_TOKENIZER}": tokens[1]}],
            "tokenizers": {tok.name: tok.vocab}, "memory": memory, "setup": setup, "prepare": [],
            "goals": goals(memory, setup, [])}


def ratios(p: dict, lim: dict) -> dict:
    """prepare / limit: MB/s per worker from launch to exit, by prepare's own clock, and MB per CPU second."""
    return {"ratio": p["mb_s_per_worker"] / lim["mb_s_per_worker"],
            "ratio_own": p["own_mb_s_per_worker"] / lim["mb_s_per_worker"],
            "ratio_cpu": p["mb_per_cpu_s"] / lim["mb_per_cpu_s"]}


def goals(memory: list[dict], setup: list[dict], throughput: list[dict]) -> dict:
    """Each goal of the module docstring: met (True / False) or not measured (None: --quick, one size)."""
    cached = [r["peak_rss_mib"] for r in memory if r["start"] == "cached"]
    grown = [r["prepare"] for r in throughput if r["tokenizer"] == TRAIN_TOKENIZER]
    flat = lambda a, b: all(within(x, y) for x, y in zip(a, b))  # noqa: E731
    return {"train_memory_flat": flat(*cached) if len(cached) == 2 else None,
            "setup_under_2s": all(r["median_s"] <= 2.0 for r in setup),
            "prepare_ratio_0_8": all(r["ratio"] >= 0.8 for r in throughput) if throughput else None,
            "prepare_memory_flat": flat(*[[p["peak_rss_mib"], p["worker_peak_rss_mib"]] for p in grown])
            if len(grown) == 2 else None}


def print_tables(r: dict, workers: int) -> None:
    print("\ncorpora: " + "; ".join(f"{c['size']}: {c['bytes'] / MB:,.1f} MB, {c['documents']:,} documents, "
                                     f"{c[f'tokens_{TRAIN_TOKENIZER}']:,} tokens ({TRAIN_TOKENIZER})"
                                     for c in r["corpora"]))
    print(f"\n1. mpt train --model {MODEL} --pp 2 --steps 1: peak RSS per rank from process start, MiB "
          "(and before the first step)")
    print(f"{'data':10s} {'start':7s} {'rank 0':>7s} {'rank 1':>7s} {'pre 0':>9s} {'pre 1':>9s} "
          f"{'launch->step s':>15s}")
    for m in r["memory"]:
        cells = [f"{v:7.0f}" for v in m["peak_rss_mib"]] + [f"{v:9.0f}" for v in m["peak_load_rss_mib"]]
        print(f"{m['data']:10s} {m['start']:7s} {' '.join(cells)} {m['launch_to_first_step_s']:15.1f}")
    if not r["memory"]:
        print("(not run: --quick)")
    print("\n2. data set-up: feed(DIR) and the first micro-batch, in this process, s")
    print(f"{'size':10s} {'index':7s} {'min':>7s} {'median':>7s}")
    for s in r["setup"]:
        print(f"{s['size']:10s} {s['index']:7s} {s['min_s']:7.3f} {s['median_s']:7.3f}")
    print(f"\n3. mpt data prepare --workers {workers} against encode_batch in {workers} processes: MB/s per worker "
          "from launch to exit (prepare's own clock), MB per CPU second; peak RSS, MiB. A larger size's ratios use "
          "the limit measured at the small size")
    print(f"{'tokenizer':14s} {'size':8s} {'limit':>6s} {'prepare':>14s} {'ratio':>12s} {'limit':>6s} "
          f"{'prepare':>8s} {'ratio':>6s} {'main':>5s} {'worker':>6s} {'limit':>6s}")
    nan = {"mb_s_per_worker": math.nan, "mb_per_cpu_s": math.nan, "peak_rss_mib": math.nan}
    for t in r["prepare"]:
        p = t["prepare"]
        lines = [(t["tokenizer"], t.get("limit", nan), "")]
        if "limit_sentences" in t:  # the same prepare against a limit that encodes the sentences it encodes
            lines.append(("  (sentences)", t["limit_sentences"], "_sentences"))
        for name, lim, key in lines:
            ratio = f"{t['ratio' + key]:4.2f} ({t['ratio_own' + key]:4.2f})"
            print(f"{name:14s} {t['size']:8s} {lim['mb_s_per_worker']:6.2f} {p['mb_s_per_worker']:5.2f} "
                  f"({p['own_mb_s_per_worker']:5.2f}) {ratio:>12s} {lim['mb_per_cpu_s']:6.2f} {p['mb_per_cpu_s']:8.2f} "
                  f"{t['ratio_cpu' + key]:6.2f} {p['peak_rss_mib']:5.0f} {p['worker_peak_rss_mib']:6.0f} "
                  f"{lim['peak_rss_mib']:6.0f}")
    print("\ngoals: " + ", ".join(f"{k} {v}" for k, v in r["goals"].items()))


if __name__ == "__main__":
    main()
