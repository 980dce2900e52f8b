"""Benchmarks, profilers and checks of mp_toolkit: programs, not part of the library (nothing under
``mp_toolkit/`` imports them). Each runs from the repository root as a module::

    .venv/bin/python -m tools.bench_pipeline --side-by-side 3
    .venv/bin/python -m tools.gpu_check --dry-run --out /tmp/gc

What they share lives here once: `tools.ranks` starts every process (ranks of a function, or the
``mpt`` command), `tools.report` prints the machine header and the closing JSON line,
`tools.predict` asks ``mpt plan`` what it predicts for a run, `tools.peers` is the benchmark
workload trained by every peer. Results with their date and machine go into BENCHMARKS.md and
RELIABILITY.md.
"""
