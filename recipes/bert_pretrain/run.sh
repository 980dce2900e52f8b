#!/usr/bin/env bash
# BERT pre-training (MLM + NSP) with mp_toolkit under the DeepSpeed launcher: pipeline x data
# parallel, LAMB with DeepSpeed's trust clamp, WarmupLR, fp16 with dynamic loss scaling: all read
# from ds_config.json; flags after the script's own override it.
#
#   ./run.sh                        this node's GPUs (NUM_GPUS, default 8): BERT-Large, sequence 128
#   HOSTFILE=hostfile ./run.sh      every node of the hostfile (slots = GPUs per node)
#   ./run.sh --smoke                2 CPU processes, bert-tiny, 30 steps on local text (< 2 min on 2 cores)
#   ./run.sh [--smoke] --steps 100 --save-dir runs/bert ...   extra flags go to `mpt train`
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
  # CPU accelerator, gloo; one thread per rank; fp32 (fp16 matmuls are slow on CPUs) and a 3-step
  # warm-up instead of the config's 2000 (the log line names the replaced keys).
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  exec "$launcher" --num_gpus 2 --master_port "$port" train.py --deepspeed_config ds_config.json \
    --model bert-tiny --data "${DATA:-$here/../../mp_toolkit}" --seq-len 64 \
    --micro-batch 8 --microbatches 2 --steps 30 --precision fp32 --lr 1e-2 --warmup-steps 3 \
    --threads 1 --no-progress "$@"
fi

common=(train.py --deepspeed_config ds_config.json --model bert-large --seq-len 128 --data "${DATA:-stdlib}"
        --steps 7038 --save-dir runs/bert_pretrain --save-every 500)
if [[ -n "${HOSTFILE:-}" ]]; then
  exec "$launcher" --hostfile "$HOSTFILE" --master_port "$port" "${common[@]}" "$@"
fi
exec "$launcher" --num_gpus "${NUM_GPUS:-8}" --master_port "$port" "${common[@]}" "$@"
