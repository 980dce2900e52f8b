"""Reading one checkpoint shard: our streamed, verified read against the file read whole and handed to
`safetensors.torch.load`, in the same run.

    .venv/bin/python -m tools.bench_checkpoint_read --mib 512 --repeats 3

Writes a checkpoint of one fp32 tensor of ``--mib`` MiB under a temporary directory (deleted after), then
in a fresh process per way and repeat reads the layer back and reports the peak resident memory it added
(``getrusage``) and the time, the best of ``--repeats``. Ours (`mp_toolkit.checkpoint.files.read_shard`)
checks the header, reads each tensor's bytes straight into it and hashes them as they arrive; the
baseline reads the file, hashes it and lets safetensors build the tensors from the bytes.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

READ = """
import hashlib, resource, sys, time
import safetensors.torch
from mp_toolkit.checkpoint import open_checkpoint
root, way = sys.argv[1], sys.argv[2]
ck = open_checkpoint(root)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if way == "ours":
    tensors = ck.read_layer("h.0")
else:
    rel = next(r for r in ck.files if r.startswith("layers/"))
    data = (ck.path / rel).read_bytes()
    assert hashlib.sha256(data).hexdigest() == ck.files[rel]["sha256"]
    tensors = safetensors.torch.load(data)
took = time.perf_counter() - start
print(took, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="the shard's tensor, MiB (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per way (default 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mpt-bench-ckpt-") as tmp:
        write = ("import sys, torch\nfrom mp_toolkit.checkpoint import save_checkpoint\n"
                 f"save_checkpoint(sys.argv[1], 1, {{'h.0': {{'h.0.w': torch.randn({args.mib} << 18)}}}})\n")
        subprocess.run([sys.executable, "-c", write, tmp], check=True, cwd=ROOT)
        result = {}
        for way in ("ours", "whole file + safetensors"):
            runs = [subprocess.run([sys.executable, "-c", READ, tmp, "ours" if way == "ours" else "baseline"],
                                   check=True, cwd=ROOT, capture_output=True, text=True).stdout.split()
                    for _ in range(args.repeats)]
            result[way] = {"seconds": min(float(t) for t, _ in runs),
                           "peak_added_mib": min(int(b) for _, b in runs) / 2**20}
    ours, base = result["ours"], result["whole file + safetensors"]
    print(json.dumps(result, indent=2))
    print(f"{args.mib} MiB shard: ours {ours['seconds']:.2f} s, +{ours['peak_added_mib']:.0f} MiB; whole file + "
          f"safetensors {base['seconds']:.2f} s, +{base['peak_added_mib']:.0f} MiB; time ratio "
          f"{base['seconds'] / ours['seconds']:.2f}x, memory ratio "
          f"{base['peak_added_mib'] / ours['peak_added_mib']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
