#!/usr/bin/env bash
# BERT pre-training (MLM + NSP) with mp_toolkit under the DeepSpeed launcher: pipeline x data
# parallel, LAMB with DeepSpeed's trust clamp, WarmupLR, fp16 with dynamic loss scaling: all read
# from ds_config.json; flags after the script's own override it. Prepare, then train: the corpus is
# split into sentences and tokenized once into memory-mapped shards (`mpt data prepare
# --split-sentences`), and the ranks draw sentence pairs from those (`--data PREPARED`).
#
#   TOKENIZER=DIR DATA=PATH ./run.sh   this node's GPUs (NUM_GPUS, default 8): BERT-Large, sequence 128
#   HOSTFILE=hostfile ... ./run.sh      every node of the hostfile (slots = GPUs per node)
#   ./run.sh --smoke                    2 CPU processes, bert-tiny, 30 steps on this repository's sources
#                                       with a 512-token WordPiece built here (< 2 min on 2 cores)
#   ./run.sh [--smoke] --steps 100 --save-dir runs/bert ...   extra flags go to `mpt train`
#
# Environment: TOKENIZER (required but for --smoke: a local BERT WordPiece with [PAD] [CLS] [SEP]
# [MASK], a directory holding tokenizer.json such as bert-large-uncased's written by save_pretrained, or
# the file), DATA (the raw corpus: text, JSON-lines or Parquet files or folders; default stdlib,
# --smoke ../../mp_toolkit), WORK (where the tokenizers and prepared data go, default runs/ here),
# PREPARED (default $WORK/bert_prepared: one per corpus), WORKERS (encoding processes, default nproc),
# PYTHON (default python3), DEEPSPEED (launcher, default deepspeed on PATH), MASTER_PORT (default
# 29500), NUM_GPUS, HOSTFILE.
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
  # A WordPiece of bert-tiny's 512 ids learnt from the corpus, and the corpus prepared with it into
  # sentences; anew on every run (a few seconds): the sources change with the repository, and a
  # prepared directory refuses other inputs.
  smoke="$work/bert_smoke"
  rm -rf "$smoke"
  "$python" ../make_tokenizer.py --kind wordpiece --vocab-size 512 --input "${DATA:-$root/mp_toolkit}" \
    --out "$smoke/tokenizer"
  mpt data prepare --input "${DATA:-$root/mp_toolkit}" --output "$smoke/prepared" --tokenizer "$smoke/tokenizer" \
    --split-sentences --workers 1 --no-progress
  # CPU accelerator, gloo; one thread per rank; fp32 (fp16 matmuls are slow on CPUs) and a 3-step
  # warm-up instead of the config's 2000 (the log line names the replaced keys), at an lr for which
  # "Lamb" (DeepSpeed's FusedLamb rule: most trust ratios sit at its 0.01 floor) learns in 30 steps.
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  exec "$launcher" --num_gpus 2 --master_port "$port" train.py --deepspeed_config ds_config.json \
    --model bert-tiny --data "$smoke/prepared" --seq-len 64 \
    --micro-batch 8 --microbatches 2 --steps 30 --precision fp32 --lr 3e-2 --warmup-steps 3 \
    --threads 1 --no-progress "$@"
fi

if [[ -z "${TOKENIZER:-}" ]]; then
  echo "run.sh: set TOKENIZER to a local BERT WordPiece tokenizer directory or tokenizer.json with [PAD] [CLS] [SEP] [MASK] (e.g. bert-large-uncased's, written by save_pretrained; ../make_tokenizer.py --kind wordpiece builds one), or run ./run.sh --smoke" >&2
  exit 2
fi
prepared="${PREPARED:-$work/bert_prepared}"
# Idempotent: a finished PREPARED is passed over at once, an interrupted one continues where it stopped,
# one prepared from other inputs or another tokenizer is refused (set another PREPARED). The ranks of
# every node read it: on several nodes it must be on a file system they all see.
mpt data prepare --input "${DATA:-stdlib}" --output "$prepared" --tokenizer "$TOKENIZER" --split-sentences \
  --workers "${WORKERS:-$(nproc)}" --val-fraction 0.0005

common=(train.py --deepspeed_config ds_config.json --model bert-large --seq-len 128 --data "$prepared"
        --steps 7038 --save-dir runs/bert_pretrain --save-every 500)
if [[ -n "${HOSTFILE:-}" ]]; then
  exec "$launcher" --hostfile "$HOSTFILE" --master_port "$port" "${common[@]}" "$@"
fi
exec "$launcher" --num_gpus "${NUM_GPUS:-8}" --master_port "$port" "${common[@]}" "$@"
