"""How large a model the ranks of this machine can hold: each rank's measured peak resident memory
against `mpt plan`'s prediction for its stage, and the largest GPT under a per-rank cap (issue 18).

Part 1 (``--runs``): for GPT-2-medium / -large shapes, pp in {1, 2, 4, 8}, tp in {1, 2}, fp32 or
bf16: `mpt plan` (method flops, AdamW, micro-batch 1, sequence 128, 8 micro-batches) gives the cut
and each stage's predicted bytes; `mpt train` trains that very cut (``--partition a,b,...``) for
2 steps on synthetic data and reports, per rank, ``peak_rss_bytes`` (resident memory from process
start: imports, meta build, materialisation and the steps) and ``peak_memory_bytes`` (the steady
steps above the post-import baseline, what the planner predicts). A rank holding several
stages (tp ranks share a stage's prediction / tp) is compared with its share.

Part 2 (``--largest``): the largest GPT (n_layer x n_embd, vocabulary 50257, 128 positions) whose
every rank stays under ``--cap-gib`` (default 3 GiB, a stand-in for one device's memory; here all
ranks share one machine, so the per-rank peak is what pipeline parallelism divides) at pp in
{1, 2, 4, 8}: the planner's memory model plus the measured post-import baseline over a grid of
depths and widths; ``--verify`` trains the largest found at each pp for 2 steps and reports the
measured per-rank peak.

    python -m tools.bench_scale --runs gpt2-medium:1,2,4,8:1 --precision fp32
    python -m tools.bench_scale --runs gpt2-large:8:1 gpt2-large:1:1 --largest --verify
    python -m tools.bench_scale --hf-dir gpt2-large:4
    python -m tools.bench_scale --longest 1,2 --verify

Part 3 (``--longest CP[,CP...]``): the longest sequence a GPT-2-small-shaped model (12 x 768, vocabulary
50257, 8192 positions, SGD with momentum in fp32 -- AdamW's state alone nears 3 GiB --, one sequence per
micro-batch, 2 micro-batches) trains with every rank
under ``--cap-gib`` at each context-parallel degree (``--cp``, one pipeline stage): the planner's memory
model plus the measured post-import baseline, over sequence lengths in steps of 256; ``--verify`` trains
it for 2 steps and reports the measured per-rank peak.

``--hf-dir MODEL:PP`` writes an HF GPT2LMHeadModel directory shaped like the preset (random weights,
written tensor by tensor into 1 GB safetensors shards with their index, as large models are
published), trains it with ``mpt train --hf DIR`` at that pp, and compares each rank's peak with
the directory's weight bytes.

Prints the machine header (`tools.report`), a table and, last, one JSON line. Nothing here is
timed; the runs are slow on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from model_zoo import gpt
from mp_toolkit.export.hf_dir import HFTarget, write_hf_dir
from mp_toolkit.export.safetensors_out import parse_size
from tools.predict import model_file, predict, rank_bytes, train_config
from tools.ranks import mpt
from tools.report import header, json_line

GIB = 2**30
MIB = 2**20
WORKLOAD = dict(micro_batch=1, microbatches=8, seq_len=128, optimizer="adamw")


def plan(model: str, pp: int, tp: int, precision: str):
    """`mpt plan`'s cut and per-stage bytes for the workload (no timing: FLOPs at a nominal rate)."""
    return predict(train_config(model, pp=pp, tp=tp, precision=precision, **WORKLOAD), method="flops")


def train(model: str, pp: int, tp: int, precision: str, boundaries: list[int] | str, out: Path, timeout: float,
          source: str = "--model") -> dict:
    """One `mpt train` run of 2 steps on that cut: its last metrics row (per-rank memory figures)."""
    metrics = out / f"{Path(model).stem}-pp{pp}-tp{tp}-{precision}.jsonl"
    cut = boundaries if isinstance(boundaries, str) else ",".join(map(str, boundaries))
    mpt("train", source, model, "--pp", str(pp), "--tp", str(tp), "--partition", cut, "--precision", precision,
        "--optimizer", WORKLOAD["optimizer"], "--micro-batch", str(WORKLOAD["micro_batch"]),
        "--seq-len", str(WORKLOAD["seq_len"]), "--microbatches", str(WORKLOAD["microbatches"]), "--steps", "2",
        "--data", "synthetic", "--threads", "1", "--no-progress", "--metrics", str(metrics),
        "--timeout", str(int(timeout)), timeout_s=timeout)
    return json.loads(metrics.read_text().splitlines()[-1])


def run_row(model: str, pp: int, tp: int, precision: str, out: Path, timeout: float) -> dict:
    p = plan(model, pp, tp, precision)
    row = train(model, pp, tp, precision, p.boundaries, out, timeout)
    predicted = rank_bytes(p, pp, tp)
    return {"model": model, "pp": pp, "tp": tp, "precision": precision, "boundaries": p.boundaries,
            "params": sum(s.params for s in p.stages), "predicted_bytes": predicted,
            "peak_memory_bytes": row["peak_memory_bytes"], "peak_rss_bytes": row["peak_rss_bytes"],
            "ratio": [m / max(1, q) for m, q in zip(row["peak_memory_bytes"], predicted)]}


def hf_directory(preset: str, folder: Path) -> tuple[Path, int]:
    """An HF GPT-2 directory shaped like our ``preset``, random weights written one tensor at a time
    into 1 GB shards (`write_hf_dir`: never the whole model in memory); (its path, weight bytes)."""
    c = gpt.PRESETS[preset]
    cfg = GPT2Config(vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer,
                     n_head=c.n_head, bos_token_id=0, eos_token_id=0)
    target = HFTarget.of(GPT2LMHeadModel, cfg, torch.float32)
    gen = torch.Generator().manual_seed(0)

    def tensors():
        for key, shape in target.kept.items():
            if key.endswith(".bias"):
                yield key, torch.zeros(shape)
            elif ".ln_" in key:
                yield key, torch.ones(shape)
            else:
                yield key, torch.randn(shape, generator=gen) * 0.02

    path = folder / f"hf-{preset}"
    write_hf_dir(target, tensors(), path, parse_size("1GB"))
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path, weights


def hf_run(preset: str, pp: int, precision: str, out: Path, timeout: float) -> dict:
    path, weights = hf_directory(preset, out)
    row = train(str(path), pp, 1, precision, "flops", out, timeout, source="--hf")
    return {"hf_dir": preset, "pp": pp, "precision": precision, "weight_bytes": weights,
            "shards": sorted(f.name for f in path.glob("*.safetensors")),
            "peak_rss_bytes": row["peak_rss_bytes"], "peak_memory_bytes": row["peak_memory_bytes"],
            "peak_load_rss_bytes": row["peak_load_rss_bytes"],
            "rss_over_weights": [b / weights for b in row["peak_rss_bytes"]],
            "load_over_weights": [b / weights for b in row["peak_load_rss_bytes"]]}


def config_file(n_layer: int, n_embd: int, folder: Path) -> str:
    return model_file({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 128, "n_embd": n_embd,
                       "n_layer": n_layer, "n_head": n_embd // 64}, folder, f"gpt-{n_layer}x{n_embd}.json")


def largest(pp: int, cap: int, baseline: int, folder: Path, precision: str) -> dict:
    """The grid point with the most parameters whose largest predicted rank fits under ``cap``."""
    best = None
    for n_embd in (512, 768, 1024, 1280, 1600, 2048, 2560, 3072, 4096):
        for n_layer in (4, 8, 12, 16, 24, 32, 48, 64, 96, 128):
            if n_layer < pp:
                continue
            model = config_file(n_layer, n_embd, folder)
            p = plan(model, pp, 1, precision)
            need = baseline + max(rank_bytes(p, pp))
            params = sum(s.params for s in p.stages)
            if need <= cap and (best is None or params > best["params"]):
                best = {"pp": pp, "model": model, "n_layer": n_layer, "n_embd": n_embd, "params": params,
                        "predicted_peak_bytes": need, "boundaries": p.boundaries}
    return best


LONG = dict(micro_batch=1, microbatches=2, optimizer="sgd")  # AdamW's state alone nears 3 GiB at this size


def longest(cp: int, cap: int, baseline: int, folder: Path, precision: str) -> dict | None:
    """The longest sequence (a multiple of 256) whose every rank is predicted under ``cap`` at ``cp``."""
    model = model_file({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 8192, "n_embd": 768, "n_layer": 12,
                        "n_head": 12}, folder, "gpt2-small-8k.json")
    best = None
    for seq in range(256, 8192 + 1, 256):
        p = predict(train_config(model, pp=1, cp=cp, seq_len=seq, precision=precision, **LONG), method="flops")
        need = baseline + max(rank_bytes(p, 1))
        if need > cap:
            break
        best = {"cp": cp, "model": model, "seq_len": seq, "predicted_peak_bytes": need}
    return best


def train_long(best: dict, precision: str, out: Path, timeout: float) -> dict:
    """2 steps of the sequence ``best`` found: the last metrics row."""
    metrics = out / f"long-cp{best['cp']}.jsonl"
    mpt("train", "--model", best["model"], "--pp", "1", "--cp", str(best["cp"]), "--precision", precision,
        "--optimizer", LONG["optimizer"], "--micro-batch", "1", "--microbatches", str(LONG["microbatches"]),
        "--seq-len", str(best["seq_len"]), "--steps", "2", "--data", "synthetic", "--threads", "1", "--no-progress",
        "--metrics", str(metrics), "--timeout", str(int(timeout)), timeout_s=timeout)
    return json.loads(metrics.read_text().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="*", default=[], metavar="MODEL:PPS:TPS",
                    help="e.g. gpt2-medium:1,2,4,8:1,2 (every combination is run)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--largest", action="store_true", help="part 2: the largest GPT under --cap-gib per rank")
    ap.add_argument("--cap-gib", type=float, default=3.0)
    ap.add_argument("--verify", action="store_true", help="train the largest found at each pp for 2 steps")
    ap.add_argument("--hf-dir", metavar="MODEL:PP", help="train an HF directory shaped like MODEL at PP (see above)")
    ap.add_argument("--longest", metavar="CP[,CP...]", help="part 3: the longest sequence under --cap-gib per rank "
                    "at each context-parallel degree")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    args = ap.parse_args()
    head = header("bench_scale")
    out = Path(tempfile.mkdtemp(prefix="bench_scale-"))
    rows, fits, long_rows = [], [], []
    for spec in args.runs:
        model, pps, tps = spec.split(":")
        for pp in map(int, pps.split(",")):
            for tp in map(int, tps.split(",")):
                r = run_row(model, pp, tp, args.precision, out, args.timeout)
                rows.append(r)
                print(f"{model:12s} pp {pp} tp {tp} {args.precision}: peak RSS from start per rank "
                      f"{[round(b / MIB) for b in r['peak_rss_bytes']]} MiB; steps above baseline "
                      f"{[round(b / MIB) for b in r['peak_memory_bytes']]} MiB vs planned "
                      f"{[round(b / MIB) for b in r['predicted_bytes']]} MiB (x{max(r['ratio']):.2f} worst)",
                      flush=True)
    if args.largest:
        small = train("gpt-small-cpu", 1, 1, "fp32", [0, 7], out, args.timeout)
        baseline = small["peak_rss_bytes"][0]  # imports and a model of a few MB: the per-process floor
        for pp in (1, 2, 4, 8):
            best = largest(pp, int(args.cap_gib * GIB), baseline, out, args.precision)
            if best and args.verify:
                got = train(best["model"], pp, 1, args.precision, best["boundaries"], out, args.timeout)
                best["measured_peak_rss_bytes"] = got["peak_rss_bytes"]
            fits.append(best)
            print(f"pp {pp}: largest under {args.cap_gib:g} GiB per rank: "
                  + (f"{best['n_layer']} x {best['n_embd']}, {best['params'] / 1e9:.2f} B parameters, predicted "
                     f"{best['predicted_peak_bytes'] / GIB:.2f} GiB" if best else "none of the grid")
                  + (f", measured {max(best['measured_peak_rss_bytes']) / GIB:.2f} GiB"
                     if best and "measured_peak_rss_bytes" in best else ""), flush=True)
    if args.longest:
        small = train("gpt-small-cpu", 1, 1, "fp32", [0, 7], out, args.timeout)
        baseline = small["peak_rss_bytes"][0]
        for cp in map(int, args.longest.split(",")):
            best = longest(cp, int(args.cap_gib * GIB), baseline, out, args.precision)
            if best and args.verify:
                got = train_long(best, args.precision, out, args.timeout)
                best["measured_peak_rss_bytes"] = got["peak_rss_bytes"]
                best["step_time_s"] = got["step_time_s"]
            long_rows.append(best)
            print(f"cp {cp}: longest sequence under {args.cap_gib:g} GiB per rank: "
                  + (f"{best['seq_len']} tokens, predicted {best['predicted_peak_bytes'] / GIB:.2f} GiB" if best
                     else "none")
                  + (f", measured {max(best['measured_peak_rss_bytes']) / GIB:.2f} GiB"
                     if best and "measured_peak_rss_bytes" in best else ""), flush=True)
    hf = None
    if args.hf_dir:
        preset, pp = args.hf_dir.split(":")
        hf = hf_run(preset, int(pp), args.precision, out, args.timeout)
        print(f"--hf {preset}-shaped directory ({hf['weight_bytes'] / GIB:.2f} GiB in {len(hf['shards'])} shards) "
              f"at pp {pp}: peak RSS per rank {[round(b / MIB) for b in hf['peak_rss_bytes']]} MiB = "
              f"{[round(x, 2) for x in hf['rss_over_weights']]} x the weights; built and loaded, before the first "
              f"step: {[round(b / MIB) for b in hf['peak_load_rss_bytes']]} MiB = "
              f"{[round(x, 2) for x in hf['load_over_weights']]} x", flush=True)
    json_line("bench_scale", head, runs=rows, largest=fits, longest=long_rows, cap_gib=args.cap_gib, hf_dir=hf)


if __name__ == "__main__":
    main()
