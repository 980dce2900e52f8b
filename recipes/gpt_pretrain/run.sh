#!/usr/bin/env bash
# GPT pre-training with mp_toolkit under the DeepSpeed launcher (pipeline x data parallel, LAMB,
# WarmupDecayLR, bf16: all read from ds_config.json; flags after the script's own override it).
#
#   ./run.sh                        this node's GPUs (NUM_GPUS, default 8): GPT-2 124M on DATA
#   HOSTFILE=hostfile ./run.sh      every node of the hostfile (slots = GPUs per node)
#   ./run.sh --smoke                2 CPU processes, a 4-layer GPT, 30 steps on local text (< 2 min on 2 cores)
#   ./run.sh [--smoke] --steps 100 --save-dir runs/gpt ...   extra flags go to `mpt train`
#
# Environment: DEEPSPEED (launcher, default: deepspeed on PATH), MASTER_PORT (default 29500),
# DATA (corpus: a local text / JSON-lines file or folder, default stdlib), NUM_GPUS, HOSTFILE.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
launcher="${DEEPSPEED:-deepspeed}"
port="${MASTER_PORT:-29500}"

if [[ "${1:-}" == "--smoke" ]]; then
  shift
  # CPU accelerator, gloo; one thread per rank. The scheduler block's 200 warm-up steps would not
  # finish in 30 steps, so the smoke run warms up over 3 (the log line names the replaced keys), at an
  # lr for which "Lamb" (DeepSpeed's FusedLamb rule: every trust ratio clamped to [0.01, 10]) learns in 30.
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  exec "$launcher" --num_gpus 2 --master_port "$port" train.py --deepspeed_config ds_config.json \
    --model smoke_model.json --data "${DATA:-$here/../../mp_toolkit}" --seq-len 64 \
    --micro-batch 4 --microbatches 4 --steps 30 --precision fp32 --lr 3e-2 --warmup-steps 3 \
    --lr-decay cosine --min-lr 3e-3 --threads 1 --no-progress "$@"
fi

common=(train.py --deepspeed_config ds_config.json --model gpt2 --seq-len 1024 --data "${DATA:-stdlib}"
        --steps 5000 --save-dir runs/gpt_pretrain --save-every 500)
if [[ -n "${HOSTFILE:-}" ]]; then
  exec "$launcher" --hostfile "$HOSTFILE" --master_port "$port" "${common[@]}" "$@"
fi
exec "$launcher" --num_gpus "${NUM_GPUS:-8}" --master_port "$port" "${common[@]}" "$@"
