"""Optimizer-side pieces of the step: global-norm clipping and the overflow test (`clip`), LAMB, LARS,
param groups, loss scaling, fp32 masters, LR schedules, the optimizer factory and the run's optimizer
and precision sections (`settings.Optim`, `loss_scaler.Numerics`).

Re-exports nothing, so that the torch-free modules (`settings`, `loss_scaler`, `lr`) import without
torch: ``mpt --help`` reads the config sections through them."""
