"""The sample stream in a checkpoint: what the manifest records of it, and resuming it on any layout.

Data position: every replica consumes m micro-batches per step, so a step at global position
s reads samples [s G, (s + 1) G) of the epoch's order (G = dp x m x micro_batch; `MicroBatches`
hands replica r the samples r, r + dp, ...). The manifest stores that position in samples; a
layout with the same micro_batch x dp product per micro-batch round resumes exactly the same
stream. Another micro_batch x dp resumes the same stream as long as the samples consumed in the
current epoch divide evenly; epochs whose length differs between the layouts (the remainder each
layout drops) are reported.
The manifest also records the data's digest (a resume on other data is refused unless
``--data-changed-ok``) and its tokenizer's sha256 (how `mpt export` finds it).
"""

from __future__ import annotations

from mp_toolkit.run.config import ConfigError, TrainConfig


def data_state(data, dp: int) -> dict:
    """What the checkpoint manifest records of this replica's `MicroBatches` (``meta["data"]``)."""
    per_round = data.micro_batch_size * dp  # samples one micro-batch round of every replica reads
    return {"epoch": data.epoch, "position": data.position, "micro_batch": data.micro_batch_size, "dp": dp,
            "samples": data.position * per_round, "samples_per_epoch": data.batches_per_epoch * per_round,
            "digest": data.digest, "tokenizer_sha256": data.tokenizer_digest}


def data_position(saved: dict, data, dp: int, seq_len_change: tuple[int, int] | None = None) -> tuple[dict, str | None]:
    """(this replica's ``MicroBatches`` state, a note when epochs differ) resuming the saved sample stream.

    ``seq_len_change`` (saved, new): the corpus is cut into sequences of another length, so the saved
    sample count means another place in it; the run continues the saved epoch at the same fraction
    of it (whole micro-batch rounds, rounded down), and says so."""
    if seq_len_change is not None:
        rounds = data.batches_per_epoch  # micro-batch rounds per epoch on the new cut
        in_epoch = saved["samples"] - saved["epoch"] * saved["samples_per_epoch"]
        done = rounds * in_epoch // max(1, saved["samples_per_epoch"])
        return ({"epoch": saved["epoch"], "position": saved["epoch"] * rounds + done},
                f"--seq-len changed {seq_len_change[0]} -> {seq_len_change[1]}: the corpus is cut anew into "
                f"{seq_len_change[1]}-token sequences; epoch {saved['epoch']} continues at the same fraction "
                f"({done} of {rounds} micro-batch rounds)")
    if (saved["micro_batch"], saved["dp"]) == (data.micro_batch_size, dp):
        return {"epoch": saved["epoch"], "position": saved["position"]}, None
    per_round = data.micro_batch_size * dp
    in_epoch = saved["samples"] - saved["epoch"] * saved["samples_per_epoch"]
    if in_epoch % per_round:
        raise ConfigError(f"the checkpoint stopped {in_epoch} samples into epoch {saved['epoch']}, not a multiple of "
                          f"--micro-batch {data.micro_batch_size} x --dp {dp} = {per_round}: resume with a "
                          f"micro-batch x dp that divides it (saved: {saved['micro_batch']} x {saved['dp']})")
    note = None
    if saved["samples_per_epoch"] != data.batches_per_epoch * per_round:
        note = (f"an epoch holds {data.batches_per_epoch * per_round} samples on this layout, "
                f"{saved['samples_per_epoch']} on the saved one: this epoch continues the same stream, later ones drop "
                "another remainder")
    return {"epoch": saved["epoch"], "position": saved["epoch"] * data.batches_per_epoch + in_epoch // per_round}, note


def check_same_data(saved: dict, data, cfg: TrainConfig, path) -> None:
    """A resume reads the data it was saved on (the prepared manifest's digest), unless --data-changed-ok."""
    before, now = saved.get("digest"), data.digest
    if before == now or cfg.dataset.data_changed_ok or before is None and "digest" not in saved:
        return
    raise ConfigError(f"{path} was trained on other data (digest {str(before)[:12]}, --data {cfg.dataset.data} is "
                      f"{str(now)[:12]}): resume on the same data, or pass --data-changed-ok to continue the saved "
                      "sample count in the new data's order")
