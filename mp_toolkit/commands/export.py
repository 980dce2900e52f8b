"""`mpt export`: a HuggingFace ``from_pretrained`` directory from a checkpoint
(`mp_toolkit.export.checkpoint`; imports transformers)."""

from __future__ import annotations

import argparse

from mp_toolkit.errors import CheckpointError, ConfigError
from mp_toolkit.export.checkpoint import export_run
from mp_toolkit.run.config import Dataset


def run(args: argparse.Namespace, argv: list[str], main=None) -> int:
    """``mpt export``; the exit code."""
    try:
        done = export_run(args.checkpoint, args.out, config=args.config, tokenizer=args.tokenizer, force=args.force,
                          max_shard_size=args.max_shard_size,
                          cache_dir=args.cache_dir if args.cache_dir is not None else Dataset().cache_dir)
    except ValueError as e:  # also HF's config errors; a CheckpointError (e.g. a hash mismatch) names --checkpoint
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"--checkpoint {line}" if isinstance(e, CheckpointError) else line) from None
    print(f"wrote {done.out}: {done.architecture}, {done.parameters:,} parameters, step {done.step} of "
          f"{args.checkpoint}; {done.tokenizer}")
    return 0
