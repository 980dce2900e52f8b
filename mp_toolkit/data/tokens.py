"""Our byte-level BPE (`train_tokenizer`), BERT's special tokens, and reading a ``tokenizer.json``.

`train_tokenizer` trains a byte-level BPE with ``<|endoftext|>`` at id 0 on the documents it is given
(``mpt data prepare --vocab-size`` gives it a bounded, seeded sample of the corpus, `mp_toolkit.data.survey`).
`SPECIAL_TOKENS` are BERT's, appended after training by ``mpt data prepare --split-sentences`` and looked
up by `mp_toolkit.data.mlm`.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mp_toolkit.errors import DataError
from mp_toolkit.progress import progress as progress_bar

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
"""BERT's special tokens, in the order a trained BERT tokenizer appends them as its last ids."""
# Bytes that UTF-8 never uses (C0, C1: overlong two-byte leads; F5..FF: past U+10FFFF). The corpus is
# strict UTF-8 text (`mp_toolkit.data.sources`), so a vocabulary too small for all 256 byte symbols plus
# <|endoftext|> leaves these out and still encodes every string, losslessly.
NON_UTF8_BYTES = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})
MIN_VOCAB = 256 - len(NON_UTF8_BYTES) + 1  # 243 byte symbols + <|endoftext|>
MAX_VOCAB = 1 << 24
"""16.8 million ids: dozens of times the largest vocabulary in use; a BPE trained to it never gets there."""


def train_tokenizer(texts: list[str], vocab_size: int, progress: bool = True) -> Tokenizer:
    """Byte-level BPE with ``<|endoftext|>`` at id 0, trained on ``texts`` (deterministic for equal texts).

    Its alphabet is every byte (`byte_alphabet`): all 256 from 257 ids up, the 243 that UTF-8 uses
    below that (GPT gpt-tiny's 256 ids: 243 bytes, <|endoftext|> and 12 merges).
    ``progress=False`` draws no bar (``mpt data prepare --no-progress``); True draws one on a terminal
    while `datasets`' bars are on (``mpt train --no-progress`` turns them off).
    """
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"vocab_size={vocab_size} is too small for byte-level BPE: use at least {MIN_VOCAB} "
            f"({MIN_VOCAB - 1} UTF-8 bytes + {EOS_TOKEN})"
        )
    if vocab_size > MAX_VOCAB:  # tokenizers' trainer aborts the process (a Rust panic) on sizes past u32
        raise DataError(f"vocab_size={vocab_size} is more than a tokenizer we train takes (at most {MAX_VOCAB})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # id 0
        initial_alphabet=byte_alphabet(vocab_size),  # every UTF-8 string is encodable
        show_progress=False,
    )
    # the bar counts documents read; the merges that follow are the tokenizer's own (quick) pass
    bar = progress_bar(texts, "training tokenizer", len(texts), progress and progress_bars_on(), "doc")
    tokenizer.train_from_iterator(bar, trainer=trainer, length=len(texts))
    return tokenizer


def byte_alphabet(vocab_size: int) -> list[str]:
    """The byte symbols (as the ByteLevel pre-tokenizer spells them) a tokenizer of ``vocab_size``
    starts from: all 256 when they fit beside <|endoftext|>, else those UTF-8 text can contain."""
    if vocab_size > 256:
        return pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel's byte -> symbol table is GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for
    # themselves, the 68 others take U+0100 onwards in byte order
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
             *range(ord("\u00ae"), ord("\u00ff") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    symbol = {**{b: chr(b) for b in shown}, **{b: chr(256 + i) for i, b in enumerate(hidden)}}
    return [symbol[b] for b in range(256) if b not in NON_UTF8_BYTES]


def progress_bars_on() -> bool:
    """Progress bars follow `datasets`' switch, which ``mpt train --no-progress`` turns off."""
    return not datasets.are_progress_bars_disabled()


def load_tokenizer_file(path: str | os.PathLike) -> tuple[Tokenizer, str]:
    """(a tokenizers ``tokenizer.json``, as HF's ``save_pretrained`` writes it, its content digest)."""
    try:
        raw = Path(path).read_bytes()
        return Tokenizer.from_str(raw.decode("utf-8")), hashlib.sha256(raw).hexdigest()
    except Exception as e:  # OSError, bad UTF-8, or the plain Exception tokenizers raises on a bad file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot read tokenizer {path}: {reason}") from None
