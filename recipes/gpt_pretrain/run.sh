#!/usr/bin/env bash
# GPT pre-training with mp_toolkit under the DeepSpeed launcher (pipeline x data parallel, LAMB,
# WarmupDecayLR, bf16: all read from ds_config.json; flags after the script's own override it).
# Prepare, then train: the corpus is tokenized once into memory-mapped shards (`mpt data prepare`),
# and the ranks read those (`--data PREPARED`).
#
#   TOKENIZER=DIR DATA=PATH ./run.sh   this node's GPUs (NUM_GPUS, default 8): GPT-2 124M on DATA
#   HOSTFILE=hostfile ... ./run.sh      every node of the hostfile (slots = GPUs per node)
#   ./run.sh --smoke                    2 CPU processes, a 4-layer GPT, 30 steps on this repository's
#                                       sources with a 512-token BPE built here (< 2 min on 2 cores)
#   ./run.sh [--smoke] --steps 100 --save-dir runs/gpt ...   extra flags go to `mpt train`
#
# Environment: TOKENIZER (required but for --smoke: a local byte-level BPE, a directory holding
# tokenizer.json such as GPT-2's written by save_pretrained, or the file), DATA (the raw corpus: text,
# JSON-lines or Parquet files or folders; default stdlib, --smoke ../../mp_toolkit), WORK (where the
# tokenizers and prepared data go, default runs/ here), PREPARED (default $WORK/gpt_prepared: one per
# corpus), WORKERS (encoding processes, default nproc), PYTHON (default python3), DEEPSPEED (launcher,
# default deepspeed on PATH), MASTER_PORT (default 29500), NUM_GPUS, HOSTFILE.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$here"
launcher="${DEEPSPEED:-deepspeed}"
port="${MASTER_PORT:-29500}"
work="${WORK:-$here/runs}"
python="${PYTHON:-python3}"

# `mpt` from this checkout, pip-installed or not (train.py does the same for the launchers' ranks)
mpt() { PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$python" -m mp_toolkit.cli "$@"; }

if [[ "${1:-}" == "--smoke" ]]; then
  shift
  # A byte-level BPE of smoke_model.json's 512 ids learnt from the corpus, and the corpus prepared with
  # it; anew on every run (a few seconds): the sources change with the repository, and a prepared
  # directory refuses other inputs.
  smoke="$work/gpt_smoke"
  rm -rf "$smoke"
  "$python" ../make_tokenizer.py --kind bpe --vocab-size 512 --input "${DATA:-$root/mp_toolkit}" \
    --out "$smoke/tokenizer"
  mpt data prepare --input "${DATA:-$root/mp_toolkit}" --output "$smoke/prepared" --tokenizer "$smoke/tokenizer" \
    --workers 1 --no-progress
  # CPU accelerator, gloo; one thread per rank. The scheduler block's 200 warm-up steps would not
  # finish in 30 steps, so the smoke run warms up over 3 (the log line names the replaced keys), at an
  # lr for which "Lamb" (DeepSpeed's FusedLamb rule: every trust ratio clamped to [0.01, 10]) learns in 30.
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  exec "$launcher" --num_gpus 2 --master_port "$port" train.py --deepspeed_config ds_config.json \
    --model smoke_model.json --data "$smoke/prepared" --seq-len 64 \
    --micro-batch 4 --microbatches 4 --steps 30 --precision fp32 --lr 3e-2 --warmup-steps 3 \
    --lr-decay cosine --min-lr 3e-3 --threads 1 --no-progress "$@"
fi

if [[ -z "${TOKENIZER:-}" ]]; then
  echo "run.sh: set TOKENIZER to a local byte-level BPE tokenizer directory or tokenizer.json (e.g. GPT-2's, written by save_pretrained; ../make_tokenizer.py --kind bpe builds one), or run ./run.sh --smoke" >&2
  exit 2
fi
prepared="${PREPARED:-$work/gpt_prepared}"
# Idempotent: a finished PREPARED is passed over at once, an interrupted one continues where it stopped,
# one prepared from other inputs or another tokenizer is refused (set another PREPARED). The ranks of
# every node read it: on several nodes it must be on a file system they all see.
mpt data prepare --input "${DATA:-stdlib}" --output "$prepared" --tokenizer "$TOKENIZER" \
  --workers "${WORKERS:-$(nproc)}" --val-fraction 0.0005

common=(train.py --deepspeed_config ds_config.json --model gpt2 --seq-len 1024 --data "$prepared"
        --steps 5000 --save-dir runs/gpt_pretrain --save-every 500)
if [[ -n "${HOSTFILE:-}" ]]; then
  exec "$launcher" --hostfile "$HOSTFILE" --master_port "$port" "${common[@]}" "$@"
fi
exec "$launcher" --num_gpus "${NUM_GPUS:-8}" --master_port "$port" "${common[@]}" "$@"
