"""Progress bars for work that may take a while: tokenizer training, corpus encoding (`mp_toolkit.data`),
layer timing (`mpt plan --method time`, `mp_toolkit.partition.measure`).

A bar is drawn only on a terminal (stderr is a TTY: never in tests, CI logs or a rank whose output is
piped), only once the work has taken ``DELAY_S`` seconds (tqdm's ``delay``: quick work draws
nothing), and not when the caller turns it off (``mpt train --no-progress``). In `mpt train` only rank
0 does this work: the other ranks read what it cached (`mp_toolkit.data.lm.rank0_first`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm

DELAY_S = 2.0


def progress(iterable: Iterable, desc: str, total: int | None = None, enabled: bool = True, unit: str = "it"):
    """``iterable`` under a tqdm bar on a terminal (module docstring); ``iterable`` itself otherwise."""
    if not (enabled and sys.stderr.isatty()):
        return iterable
    return tqdm(iterable, desc=desc, total=total, unit=unit, delay=DELAY_S, file=sys.stderr, leave=False,
                dynamic_ncols=True)
