"""`mpt train`: the run above the core — its typed config and checks, the model families it trains,
the loop every rank runs, checkpoint state, metrics and the launcher code (imports `data`, `ds`, `hf`
and the core; nothing below imports it)."""
