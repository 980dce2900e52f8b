"""The one GPU check (issue 23): the toolkit's CUDA paths run and measured in one go, one JSON out.

Sections, in order (each records its own error and the run goes on):

1. ``device``: the GPU, its dense bf16/fp16/fp32 peak from `PEAK_TFLOPS` by device name.
2. ``memory``: `memstats.DeviceMemory` on the device (the caching allocator's peak and reset).
3. ``oracle``: pp=2 against one process, fp32, both on the device, two ranks sharing it (NCCL where
   each rank has a GPU, else gloo with messages staged through the host): parameters must be
   bitwise equal (DESIGN.md invariant 1).
   ``precision``: pp=1 bf16 and fp16 against fp32 on the device, bounded by `FLOOR_K` times the same
   precision's distance from fp32 on CPU, measured in this run (invariant 10's measured floor; CPU
   kernels are the reference rounding).
4. ``train``: ``mpt train --precision bf16`` and ``fp16`` for 20 steps of GPT-2 small's shape at pp=2
   (the launcher's own path: two ranks on the device) on synthetic (uniform) token ids: exit 0, every
   step, finite losses that do not climb, at most a quarter of the steps skipped by loss scaling.
5. ``throughput``: ``mpt train`` at pp=1, bf16, GPT-2 small and medium: median tokens/s over the
   steps after the warm-up, achieved TFLOP/s (`flops_per_token`) and MFU against the peak.
6. ``lamb``: our LAMB step on GPT-2-medium-shaped fp32 tensors against the copy bandwidth measured
   here (an exact LAMB step moves 28 bytes per parameter; tools/bench_optim.py's bound).

    python -m tools.gpu_check --out runs/gpu_check          # on a GPU machine (tools/gpu_check.sh sets up)
    python -m tools.gpu_check --dry-run --out /tmp/gc       # the same code paths on CPU, tiny sizes, seconds

Prints the machine header (`tools.report`) first; writes ``OUT/gpu_check.txt`` (a short summary,
printed too) and ``OUT/gpu_check.json`` (the report as one JSON line, printed last); exits 1 when a
check failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from model_zoo.gpt import GPT, PRESETS, GPTConfig, lm_loss
from mp_toolkit import cli
from mp_toolkit.engine.pipeline import PipelineEngine
from mp_toolkit.layers import LayerList
from mp_toolkit.optim.lamb import LAMB
from mp_toolkit.parallel.context import build_context
from mp_toolkit.partition import uniform
from mp_toolkit.partition.memstats import DeviceMemory
from mp_toolkit.run.launch import init_distributed, launcher_env
from tools.ranks import run_ranks
from tools.report import header, json_line

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Dense (no sparsity) tensor-core peaks from NVIDIA's data sheets; fp32 is the non-tensor-core rate.
    # Matched against torch.cuda.get_device_properties(i).name, first key contained in it wins.
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM
    "GH200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
}
SECTIONS = ("memory", "oracle", "precision", "train", "throughput", "lamb")
FLOOR_K = 8  # tests/floor.py's K: a parallel / device result may err up to 8x the measured floor
LAMB_BYTES_PER_PARAM = 28  # params, grads, two moments read; params, two moments written; 4 bytes each


@dataclass(frozen=True)
class Sizes:
    """What each section runs: the real sizes on a GPU, tiny ones for ``--dry-run``. The oracle's model
    is untied (a tie across stages sums its two gradients in another order: equal to rounding only)."""

    oracle: GPTConfig
    oracle_batch: tuple[int, int, int, int]  # steps, micro-batches, micro-batch, sequence
    train_model: str
    train_args: tuple[str, ...]
    train_steps: int
    throughput: tuple[tuple[str, tuple[str, ...]], ...]  # (model, mpt train flags)
    throughput_steps: int
    lamb_shapes: GPTConfig

    @classmethod
    def for_run(cls, dry: bool) -> "Sizes":
        if dry:
            tiny = ("--seq-len", "32", "--micro-batch", "2", "--microbatches", "2")
            return cls(GPTConfig(vocab_size=96, n_positions=32, n_embd=32, n_layer=4, n_head=4,
                                 tie_word_embeddings=False),
                       (2, 2, 2, 16),
                       "gpt-tiny", tiny, 3, (("gpt-tiny", tiny),), 4,
                       GPTConfig(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4))
        return cls(GPTConfig(vocab_size=4096, n_positions=256, n_embd=256, n_layer=4, n_head=8,
                             tie_word_embeddings=False),
                   (3, 4, 4, 64),
                   "gpt2", ("--seq-len", "1024", "--micro-batch", "8", "--microbatches", "4"), 20,
                   (("gpt2", ("--seq-len", "1024", "--micro-batch", "16", "--microbatches", "2")),
                    ("gpt2-medium", ("--seq-len", "1024", "--micro-batch", "8", "--microbatches", "4"))), 12,
                   PRESETS["gpt2-medium"])


def device_peak(name: str) -> tuple[dict[str, float] | None, str | None]:
    """(peak TFLOP/s per precision, the table key) for a device name; (None, None) when unknown."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks, key
    return None, None


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the matrix-multiply parameters (each block's four projections and
    the LM head; embedding lookups are not products) + 12 x layers x seq x width for attention's two
    products, forward and backward (PaLM, Chowdhery et al. 2022, appendix B)."""
    d, layers = cfg.n_embd, cfg.n_layer
    matmul_params = layers * 12 * d * d + cfg.vocab_size * d
    return 6 * matmul_params + 12 * layers * seq_len * d


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_section(device: torch.device) -> dict:
    out = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "cpus": os.cpu_count()}
    if device.type != "cuda":
        return {**out, "name": "cpu (dry run)", "peak_source": None, "peak_tflops": None}
    props = torch.cuda.get_device_properties(device)
    peaks, key = device_peak(props.name)
    return {**out, "name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gib": props.total_memory / 2**30, "sms": props.multi_processor_count,
            "gpus": torch.cuda.device_count(), "bf16_supported": torch.cuda.is_bf16_supported(),
            "peak_tflops": peaks, "peak_source": f"PEAK_TFLOPS[{key!r}]" if key else "unknown device: no MFU"}


def memory_section(device: torch.device) -> dict:
    """`DeviceMemory` figures around a 64 MiB tensor: its peak rise, the drop on free, the reset."""
    memory = DeviceMemory.of(device)
    memory.keep_freed()
    memory.release()
    memory.reset_peak()
    start = memory.peak_bytes()
    x = torch.ones(16 << 20, device=device)
    rise = memory.peak_bytes() - start
    del x
    memory.release()
    memory.reset_peak()
    after = memory.peak_bytes() - memory.in_use_bytes()
    ok = rise >= 60 << 20 and after < (8 << 20)
    return {"peak_rise_mib": rise / 2**20, "peak_after_reset_mib": after / 2**20, "ok": ok,
            "cached_mib": torch.cuda.memory_reserved(device) / 2**20 if device.type == "cuda" else None}


# ---- 3. the oracle on the device ------------------------------------------------------------------

def batches(cfg: GPTConfig, steps: int, m: int, micro: int, seq: int) -> list[list[tuple]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(m):
            s = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g)
            step.append((s[:, :-1].contiguous(), s[:, 1:].contiguous()))
        out.append(step)
    return out


def adamw(params):
    return torch.optim.AdamW([p[1] if isinstance(p, tuple) else p for p in params], lr=1e-3, weight_decay=0.01,
                             foreach=True)


def engine_run(cfg: GPTConfig, data, device: torch.device, precision: str, pp: int = 1) -> dict[str, torch.Tensor]:
    """Our engine on ``device`` (this rank's stages when pp > 1); final parameters, on the host."""
    torch.manual_seed(0)
    layers = LayerList.from_model(GPT(cfg))
    ctx = build_context(pp, device=device)
    engine = PipelineEngine(layers, ctx, uniform(len(layers), pp), len(data[0]), "1f1b", optimizer=adamw,
                            loss_fn=lm_loss, precision=precision)
    losses = [engine.train_batch(iter(step)).loss for step in data]
    params = {n: p.detach().float().cpu() for n, p in engine.named_parameters()}
    return {"params": params, "losses": losses}


def reference_run(cfg: GPTConfig, data, device: torch.device) -> dict:
    """One process, plain gradient accumulation on ``device`` (tests/oracle_workers.py's reference)."""
    torch.manual_seed(0)
    model = LayerList.from_model(GPT(cfg)).to(device)
    opt = adamw(list(model.parameters()))
    losses = []
    for step in data:
        total = torch.zeros((), device=device)
        for x, y in step:
            loss = lm_loss(model(x.to(device)), y.to(device)) / len(step)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
    params = {f"{n}.{path}": p.detach().cpu() for n, layer in zip(model.names, model.layers)
              for path, p in layer.named_parameters()}
    return {"params": params, "losses": losses}


def pp_rank(spec: dict) -> dict:
    """One rank of `pipeline_on_device` (`tools.ranks.run_ranks`): `engine_run` at pp = the world size,
    and on rank 0 the one-process reference too (in a rank's own process, as in tests/oracle_workers.py)."""
    torch.set_num_threads(1)
    env = launcher_env()
    device = init_distributed(env, spec["timeout_s"] / 2)  # NCCL where each rank has a GPU, else gloo
    torch.use_deterministic_algorithms(True, warn_only=True)  # the same kernels for the same shapes
    cfg, data = GPTConfig(**spec["config"]), batches(GPTConfig(**spec["config"]), *spec["batch"])
    out = engine_run(cfg, data, device, "fp32", pp=env.world_size)
    if env.rank == 0:
        out["reference"] = reference_run(cfg, data, device)
    return {**out, "backend": dist.get_backend(), "device": str(device)}


def pipeline_on_device(cfg: GPTConfig, batch: tuple[int, ...], device: torch.device, world: int = 2) -> list[dict]:
    """`engine_run` at pp=``world`` on ``world`` ranks sharing ``device``'s GPUs (none for the CPU) on
    `batches` ``(cfg, *batch)``; each rank's result."""
    # cuBLAS picks reproducible reductions only with a fixed workspace (torch's reproducibility notes)
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **({"CUDA_VISIBLE_DEVICES": ""} if device.type == "cpu" else {})}
    return run_ranks("tools.gpu_check:pp_rank", {"config": asdict(cfg), "batch": list(batch)}, world,
                     timeout_s=300, env=env)


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Relative Frobenius distance of two parameter sets (over all tensors)."""
    num = sum(float((a[n] - b[n]).double().pow(2).sum()) for n in b)
    den = sum(float(b[n].double().pow(2).sum()) for n in b)
    return math.sqrt(num / den)


def oracle_section(device: torch.device, sizes: Sizes) -> dict:
    """pp=2 on two ranks sharing ``device`` against one process on it, fp32: bitwise (invariant 1)."""
    ranks = pipeline_on_device(sizes.oracle, sizes.oracle_batch, device)
    ref = ranks[0]["reference"]
    pp_params = {n: p for r in ranks for n, p in r["params"].items()}
    unequal = sorted(n for n, p in pp_params.items() if not torch.equal(p, ref["params"][n]))
    max_diff = max(float((p - ref["params"][n]).abs().max()) for n, p in pp_params.items())
    return {"backend": ranks[0]["backend"], "devices": [r["device"] for r in ranks],
            "tensors": len(pp_params), "unequal": unequal[:5], "max_abs_diff": max_diff,
            "losses": ranks[-1]["losses"], "reference_losses": ref["losses"],
            "ok": not unequal and len(pp_params) == len(ref["params"])}


def precision_section(device: torch.device, sizes: Sizes) -> dict:
    """pp=1 bf16 and fp16 on ``device`` against fp32 on it, within `FLOOR_K` x the same distance on CPU."""
    cfg = sizes.oracle
    data = batches(cfg, *sizes.oracle_batch)
    cpu = torch.device("cpu")
    on_device32, on_cpu32 = engine_run(cfg, data, device, "fp32"), engine_run(cfg, data, cpu, "fp32")
    out = {}
    for precision in ("bf16", "fp16"):
        err = distance(engine_run(cfg, data, device, precision)["params"], on_device32["params"])
        floor = distance(engine_run(cfg, data, cpu, precision)["params"], on_cpu32["params"])
        out[precision] = {"distance_from_fp32": err, "cpu_floor": floor, "bound": FLOOR_K * floor,
                          "ok": err <= FLOOR_K * floor}
    return {"precisions": out, "ok": all(v["ok"] for v in out.values())}


# ---- 4, 5. mpt train runs --------------------------------------------------------------------------

def mpt_train(model: str, precision: str, steps: int, flags: tuple[str, ...], pp: int, out: Path,
              threads: int) -> dict:
    """``mpt train`` (`mp_toolkit.cli.main`, the console command's own entry): at pp=1 in this process,
    at pp=2 the command starts its two ranks itself. Its metrics rows and exit code."""
    metrics = out / f"train_{model}_{precision}_pp{pp}.jsonl"
    metrics.unlink(missing_ok=True)
    argv = ["train", "--model", model, "--precision", precision, "--pp", str(pp), "--steps", str(steps),
            "--data", "synthetic", "--optimizer", "adamw", "--lr", "3e-4", "--warmup-steps", "2",
            "--threads", str(threads), "--metrics", str(metrics), "--no-progress", *flags]
    t = time.perf_counter()
    try:
        code = cli.main(argv)
    except SystemExit as e:  # a refused flag or config: exit 2 with its one line on stderr
        code = e.code if isinstance(e.code, int) else 2
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {"command": "mpt " + " ".join(argv), "exit": code, "wall_s": time.perf_counter() - t, "rows": rows}


def train_section(sizes: Sizes, out: Path, threads: int) -> dict:
    runs = {}
    for precision in ("bf16", "fp16"):
        r = mpt_train(sizes.train_model, precision, sizes.train_steps, sizes.train_args, 2, out, threads)
        losses = [row["loss"] for row in r["rows"] if not row.get("skipped")]
        skipped = sum(bool(row.get("skipped")) for row in r["rows"])
        # synthetic ids are uniform: the loss stays near ln(vocab), so the check is that it stays finite
        # and does not climb, and that dynamic loss scaling skipped at most a few steps
        ok = (r["exit"] == 0 and len(r["rows"]) == sizes.train_steps and len(losses) >= 2
              and all(math.isfinite(v) for v in losses) and losses[-1] <= 1.02 * losses[0]
              and skipped <= sizes.train_steps // 4)
        runs[precision] = {"command": r["command"], "exit": r["exit"], "wall_s": r["wall_s"],
                           "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
                           "skipped_steps": skipped, "ok": ok}
    return {"runs": runs, "ok": all(v["ok"] for v in runs.values())}


def throughput_section(sizes: Sizes, peaks: dict | None, out: Path, threads: int, precision: str) -> dict:
    rows = {}
    for model, flags in sizes.throughput:
        r = mpt_train(model, precision, sizes.throughput_steps, flags, 1, out, threads)
        seq = int(flags[flags.index("--seq-len") + 1])
        timed = [row["tokens_per_s"] for row in r["rows"][2:]]  # after two warm-up steps
        tokens_s = statistics.median(timed) if timed else None
        per_token = flops_per_token(PRESETS[model], seq)
        tflops = tokens_s * per_token / 1e12 if tokens_s else None
        peak = peaks.get(precision) if peaks else None
        last = r["rows"][-1] if r["rows"] else {}
        rows[model] = {"command": r["command"], "exit": r["exit"], "tokens_per_s": tokens_s,
                       "flops_per_token": per_token, "achieved_tflops": tflops, "peak_tflops": peak,
                       "mfu": tflops / peak if tflops and peak else None,
                       "peak_memory_bytes": last.get("peak_memory_bytes"),
                       "ok": r["exit"] == 0 and tokens_s is not None}
    return {"precision": precision, "models": rows, "ok": all(v["ok"] for v in rows.values())}


# ---- 6. LAMB against the copy bandwidth -----------------------------------------------------------

def lamb_shapes(cfg: GPTConfig) -> list[tuple[int, ...]]:
    """A GPT's parameter shapes (tools/bench_optim.py's layout)."""
    w = cfg.n_embd
    shapes = [(cfg.vocab_size, w), (cfg.n_positions, w)]
    for _ in range(cfg.n_layer):
        shapes += [(w,), (w,), (3 * w, w), (3 * w,), (w, w), (w,), (w,), (w,), (4 * w, w), (4 * w,), (w, 4 * w), (w,)]
    return shapes + [(w,), (w,)]


def copy_fn(numel: int, device: torch.device):
    """A params-sized ``dst.copy_(src)`` on ``device``: 2 x 4 bytes moved per element."""
    src, dst = torch.rand(numel, device=device), torch.empty(numel, device=device)
    return lambda: dst.copy_(src)


def median_ms(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def lamb_section(device: torch.device, sizes: Sizes, repeats: int) -> dict:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in lamb_shapes(sizes.lamb_shapes)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    numel = sum(p.numel() for p in params)
    copy_ms = median_ms(copy_fn(numel, device), device, repeats)
    bandwidth = 2 * 4 * numel / (copy_ms / 1e3)  # one read and one write of 4 bytes per element
    opt = LAMB(params, lr=1e-3, weight_decay=0.01)
    step_ms = median_ms(opt.step, device, repeats)
    bound_ms = 1e3 * LAMB_BYTES_PER_PARAM * numel / bandwidth
    return {"params": numel, "tensors": len(params), "copy_GBps": bandwidth / 1e9, "bound_ms": bound_ms,
            "lamb_ms": step_ms, "x_bound": step_ms / bound_ms, "goal_x_bound": 2.0, "ok": math.isfinite(step_ms)}


# ---- the run --------------------------------------------------------------------------------------

def run(args) -> dict:
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible to torch (torch.version.cuda = "
                         f"{torch.version.cuda}); install a CUDA build of torch or use --dry-run")
    sizes = Sizes.for_run(args.dry_run)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"dry_run": args.dry_run}
    report["device"] = device_section(device)
    peaks = report["device"].get("peak_tflops")
    sections = {
        "memory": lambda: memory_section(device),
        "oracle": lambda: oracle_section(device, sizes),
        "precision": lambda: precision_section(device, sizes),
        "train": lambda: train_section(sizes, out, args.threads),
        "throughput": lambda: throughput_section(sizes, peaks, out, args.threads, "bf16"),
        "lamb": lambda: lamb_section(device, sizes, 3 if args.dry_run else 20),
    }
    for name, fn in sections.items():
        if args.only and name not in args.only:
            continue
        t = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # one section's failure is recorded; the others still run
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = time.perf_counter() - t
        print(f"gpu_check: {name} {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['seconds']:.0f} s)",
              flush=True)
    report["ok"] = all(report[n]["ok"] for n in sections if n in report)
    return report


def summary(report: dict, head: dict) -> str:
    d = report["device"]
    lines = [f"gpu_check {'(dry run, CPU) ' if report['dry_run'] else ''}{head['date']}: {d['name']}, "
             f"torch {d['torch']} (CUDA {d['cuda']}); peak {d.get('peak_tflops')} TFLOP/s ({d.get('peak_source')})"]
    if "memory" in report and "peak_rise_mib" in report["memory"]:
        m = report["memory"]
        lines.append(f"memory: 64 MiB tensor -> peak +{m['peak_rise_mib']:.0f} MiB, after reset "
                     f"+{m['peak_after_reset_mib']:.1f} MiB  {'ok' if m['ok'] else 'FAILED'}")
    p = report.get("oracle", {})
    if "tensors" in p:
        lines.append(f"oracle pp=2 fp32 ({p['backend']}, {'/'.join(p['devices'])}): {p['tensors']} tensors, "
                     f"{'bitwise equal' if not p['unequal'] else 'NOT equal: ' + ', '.join(p['unequal'])} "
                     f"(max |d| {p['max_abs_diff']:.1e})")
    for name, v in report.get("precision", {}).get("precisions", {}).items():
        lines.append(f"pp=1 {name} vs fp32: {v['distance_from_fp32']:.2e} (bound {FLOOR_K} x CPU floor "
                     f"{v['cpu_floor']:.2e})  {'ok' if v['ok'] else 'FAILED'}")
    for name, v in report.get("train", {}).get("runs", {}).items():
        lines.append(f"mpt train {name} pp=2: exit {v['exit']}, loss {v['first_loss']} -> {v['last_loss']}, "
                     f"{v['skipped_steps']} skipped  {'ok' if v['ok'] else 'FAILED'}")
    for model, v in report.get("throughput", {}).get("models", {}).items():
        mfu = f"{100 * v['mfu']:.1f}% MFU" if v["mfu"] is not None else "MFU n/a"
        tok = (f"{v['tokens_per_s']:,.0f} tokens/s, {v['achieved_tflops']:.1f} TFLOP/s" if v["tokens_per_s"]
               else "no figure")
        lines.append(f"throughput {model} pp=1 {report['throughput']['precision']}: {tok}, {mfu}")
    lam = report.get("lamb", {})
    if "x_bound" in lam:
        lines.append(f"LAMB {lam['params']:,} params: {lam['lamb_ms']:.2f} ms, copy {lam['copy_GBps']:.0f} GB/s -> "
                     f"bound {lam['bound_ms']:.2f} ms, {lam['x_bound']:.2f}x (goal <= 2x)")
    for name in SECTIONS:
        if "error" in report.get(name, {}):
            lines.append(f"{name}: ERROR {report[name]['error']}")
    lines.append(f"overall: {'ok' if report['ok'] else 'FAILED'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same code paths on CPU at tiny sizes (seconds)")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_check"), help="folder for the JSON, summary and logs")
    ap.add_argument("--only", nargs="*", default=None, choices=SECTIONS, help="sections to run (default: all)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    args = ap.parse_args(argv)
    head = header("gpu_check")
    report = run(args)
    text = summary(report, head)
    (args.out / "gpu_check.txt").write_text(text)
    print(text, end="")
    json_line("gpu_check", head, path=args.out / "gpu_check.json", **report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
