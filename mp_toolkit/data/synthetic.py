"""Synthetic text: ``--data synthetic`` for BERT (GPT's synthetic data draws token ids, `lm`)."""

from __future__ import annotations

import random


def synthetic_documents(seed: int, docs: int = 400, lines: int = 16, words: int = 12) -> list[str]:
    """Documents of lines of pseudo-words from a 400-word Zipf-like vocabulary (BERT's ``--data synthetic``):
    text with token statistics to learn, made in milliseconds without any file."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    vocab = ["".join(rng.choice(letters[: 6 + i % 20]) for _ in range(2 + i % 7)) for i in range(400)]
    weights = [1.0 / (1 + i) for i in range(len(vocab))]
    return ["\n".join(" ".join(rng.choices(vocab, weights, k=words)) for _ in range(lines)) for _ in range(docs)]
