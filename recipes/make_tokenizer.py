"""Build a small tokenizer locally from text with the `tokenizers` library: ``OUT/tokenizer.json``, for
``mpt data prepare --tokenizer OUT`` (the recipes' smoke runs, or a corpus of your own). Nothing is downloaded.

    python recipes/make_tokenizer.py --kind bpe --vocab-size 512 --input mp_toolkit --out runs/gpt_tokenizer
    python recipes/make_tokenizer.py --kind wordpiece --vocab-size 512 --input corpus/ a.jsonl --out runs/bert_tok

The inputs are read as ``mpt data prepare`` reads them (`mp_toolkit.data.sources`: text files, JSON lines,
Parquet, ..., directories searched, ``stdlib``), so the tokenizer learns from the documents it will encode.

- ``--kind bpe``: GPT-2's byte-level BPE: the ByteLevel pre-tokenizer (GPT-2's split regex, no prefix
  space), all 256 byte symbols in the alphabet (any text encodes; no unknown token), ``<|endoftext|>``
  (id 0), which ``mpt data prepare`` appends to every document, and the ByteLevel decoder.
- ``--kind wordpiece``: BERT's uncased WordPiece: ``[PAD] [UNK] [CLS] [SEP] [MASK]`` as ids 0-4, the
  BertNormalizer (lowercase, accents stripped), the BertPreTokenizer, ``##`` continuations, the WordPiece
  decoder and the ``[CLS] A [SEP] B [SEP]`` post-processor (``mpt data prepare`` encodes sentences without
  it; BERT pairs add their own). The alphabet is capped at a quarter of the vocabulary, so a small one is
  not all single characters; a word with a character left out becomes [UNK].

The vocabulary has at most ``--vocab-size`` tokens (fewer when the text has fewer merges to learn), so a
model with ``vocab_size`` at least that can train on it. A bad input or value: one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout that is not pip-installed

from mp_toolkit.data.sources import expand  # noqa: E402
from mp_toolkit.errors import DataError  # noqa: E402

EOS_TOKEN = "<|endoftext|>"
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
BYTES = 256


class Documents:
    """The inputs' documents, counted as they are read (the summary line reports them)."""

    def __init__(self, inputs: list[str], json_key: str):
        self.sources = expand(inputs)
        self.json_key = json_key
        self.count = self.bytes = 0

    def __iter__(self):
        for source in self.sources:
            for text, _ in source.documents(self.json_key):
                if text:  # None: a stdlib file that is not UTF-8, passed over as prepare does
                    self.count += 1
                    self.bytes += len(text.encode("utf-8"))
                    yield text


def byte_level_bpe(vocab_size: int) -> tuple[Tokenizer, trainers.Trainer]:
    """GPT-2's byte-level BPE, untrained, and its trainer (256 bytes + <|endoftext|> + merges)."""
    if vocab_size < BYTES + 1:
        raise DataError(f"--vocab-size {vocab_size} is too small for a byte-level BPE: use at least {BYTES + 1} "
                        f"({BYTES} byte symbols + {EOS_TOKEN})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    return tok, trainer


def bert_wordpiece(vocab_size: int) -> tuple[Tokenizer, trainers.Trainer]:
    """BERT's uncased WordPiece, untrained, and its trainer; [PAD] [UNK] [CLS] [SEP] [MASK] are ids 0-4."""
    least = 4 * (len(BERT_SPECIALS) + 1)
    if vocab_size < least:
        raise DataError(f"--vocab-size {vocab_size} is too small for a WordPiece vocabulary: use at least {least}")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    cls, sep = BERT_SPECIALS.index("[CLS]"), BERT_SPECIALS.index("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    # Each alphabet character may also enter as its "##" continuation, so a quarter of the vocabulary
    # for the alphabet leaves at least half of it for merges.
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(BERT_SPECIALS),
                                        limit_alphabet=vocab_size // 4, continuing_subword_prefix="##",
                                        show_progress=False)
    return tok, trainer


KINDS = {"bpe": (byte_level_bpe, "byte-level BPE"), "wordpiece": (bert_wordpiece, "WordPiece")}


def make_tokenizer(kind: str, vocab_size: int, inputs: list[str], out: str | os.PathLike,
                   json_key: str = "text") -> str:
    """Train a ``kind`` tokenizer of at most ``vocab_size`` tokens on ``inputs`` and write
    ``out/tokenizer.json`` (whole or absent: written beside it, then renamed); returns the summary line."""
    build, title = KINDS[kind]
    tok, trainer = build(vocab_size)
    docs = Documents(inputs, json_key)
    tok.train_from_iterator(docs, trainer)
    if docs.count == 0:
        raise DataError(f"--input {' '.join(inputs)}: no document to train on (every text is empty)")
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:  # the trainer's vocab_size is a target: say so rather than hand over a larger one
        raise DataError(f"the {title} has {size} tokens, more than --vocab-size {vocab_size}: give a larger one")
    target = Path(out) / "tokenizer.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".tokenizer.json.{os.getpid()}.partial")
    tok.save(str(partial))
    os.replace(partial, target)
    return (f"wrote {target}: {title}, {size} tokens, trained on {docs.count:,} documents "
            f"({docs.bytes / 1e6:,.2f} MB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_tokenizer.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=sorted(KINDS), required=True,
                        help="bpe: GPT-2's byte-level BPE; wordpiece: BERT's uncased WordPiece")
    parser.add_argument("--vocab-size", type=int, required=True, help="the most tokens the vocabulary holds")
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="files, directories (searched) or 'stdlib', read as `mpt data prepare` reads them")
    parser.add_argument("--out", required=True, metavar="DIR", help="where tokenizer.json is written")
    parser.add_argument("--json-key", default="text", help="the JSON field / column holding the text (default text)")
    args = parser.parse_args(argv)
    try:
        print(make_tokenizer(args.kind, args.vocab_size, args.input, args.out, args.json_key))
    except DataError as e:
        print(f"make_tokenizer.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
