#!/usr/bin/env bash
# Train with torchrun, TorchTitan style:
#   CONFIG_FILE=train_configs/X.toml NGPU=8 ./run_train.sh [--section.key value ...]
# Defaults: train_configs/debug_cpu.toml; NGPU = the GPUs present, else 2 CPU processes.
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (static c10d rendezvous), or
# RDZV_ENDPOINT (+ RDZV_ID) for an elastic c10d rendezvous. See docs/launch.md.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh
sb_ensure_venv

CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_cpu.toml}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  NGPU="${NGPU:-$(nvidia-smi -L | wc -l)}"
else
  NGPU="${NGPU:-2}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # CPU: one thread per process
fi
NNODES="${NNODES:-1}"
LOG_RANK="${LOG_RANK:-0}"

for arg in "$@"; do
  case "$arg" in
    -h|--help) exec .venv/bin/python -m sb_titan.tools.train --config_file "$CONFIG_FILE" "$@" ;;
  esac
done

# Fail fast, once, with one clear line on a bad config, profile or dataset (before
# spawning ranks; sb_titan/preflight.py).
WORLD_SIZE=$((NGPU * NNODES)) \
  .venv/bin/python -m sb_titan.tools.train --check-config --config_file "$CONFIG_FILE" "$@"

if [ -n "${RDZV_ENDPOINT:-}" ]; then
  launch=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT"
          --rdzv_id="${RDZV_ID:-sb_titan}")
elif [ "$NNODES" -gt 1 ]; then
  launch=(--nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK for multi-node}"
          --master_addr="${MASTER_ADDR:?set MASTER_ADDR for multi-node}"
          --master_port="${MASTER_PORT:-29500}")
else
  launch=(--standalone)
fi

exec .venv/bin/torchrun "${launch[@]}" --nproc_per_node="$NGPU" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m sb_titan.tools.train --config_file "$CONFIG_FILE" "$@"
