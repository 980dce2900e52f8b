"""`mpt data prepare / merge / verify`: a corpus tokenized into a prepared directory
(`mp_toolkit.data.prepare`, `mp_toolkit.data.prepared`).

    mpt data prepare --input corpus/ --output prepared/ --vocab-size 8192 --val-fraction 0.01
    mpt data prepare --input a.jsonl.gz b.parquet --output prepared/ --tokenizer gpt2/ --shard 0/2  # and 1/2
    mpt data merge prepared/
    mpt data verify prepared/

A bad input, a locked or differently prepared DIR, a damaged shard: one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import shlex

from mp_toolkit.data.prepare import merge, parse_shard, prepare, shard_counts, verify
from mp_toolkit.errors import DataError


def run(args: argparse.Namespace, argv: list[str], main=None) -> int:
    """``mpt data ...``; the exit code."""
    if args.data_command == "prepare":
        return _prepare(args, argv)
    if args.data_command == "merge":
        manifest = merge(args.dir)
        totals = "; ".join(f"{split} {t['documents']:,} documents, {t['tokens']:,} tokens"
                           for split, t in manifest["totals"].items())
        print(f"merged {len(manifest['parts'])} parts into {args.dir / 'manifest.json'}: {totals}")
        return 0
    corpus = verify(args.dir)
    print(f"OK {args.dir}: train {shard_counts(corpus.train)}; val {shard_counts(corpus.val)}; every index valid"
          + ("; every file matches its sha256" if corpus.path.is_dir() else " (a Megatron prefix: no digests)"))
    return 0


def _prepare(args: argparse.Namespace, argv: list[str]) -> int:
    if len(args.json_keys) != 1:
        raise DataError(f"--json-keys {' '.join(args.json_keys)}: give one key (Megatron writes a corpus per key; "
                        "prepare each into its own --output)")
    given = {name: value for name, value in (
        ("val_fraction", args.val_fraction), ("seed", args.seed), ("sample_bytes", args.tokenizer_sample_bytes),
        ("chunk_docs", args.chunk_docs), ("val_min_docs", args.val_min_docs)) if value is not None}
    done = prepare(args.input, args.output, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                   workers=args.workers if args.workers is not None else os.cpu_count() or 1,
                   json_key=args.json_keys[0], split_sentences=args.split_sentences, append_eod=args.append_eod,
                   val_docs=args.val_docs, shard=parse_shard(args.shard) if args.shard else (0, 1),
                   progress=not args.no_progress, command=f"mpt {shlex.join(argv)}", **given)
    print(done.line())
    return 0
