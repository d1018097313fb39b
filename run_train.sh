#!/usr/bin/env bash
# Train with torchrun, TorchTitan style:
#   CONFIG_FILE=train_configs/X.toml NGPU=8 ./run_train.sh [--section.key value ...]
# Defaults: train_configs/debug_cpu.toml; NGPU = the GPUs present, else 2 CPU processes.
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, or RDZV_ENDPOINT (+ RDZV_ID);
# both use a c10d rendezvous, so a restarted job re-forms across nodes.
# Elastic recovery: a failed rank restarts the job from its last checkpoint, up to
# MAX_RESTARTS (default 3) times; errors a restart would repeat are not retried.
# See docs/launch.md.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh
sb_ensure_venv
sb_warm_bytecode

CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_cpu.toml}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  NGPU="${NGPU:-$(nvidia-smi -L | wc -l)}"
else
  NGPU="${NGPU:-2}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # CPU: one thread per process
fi
NNODES="${NNODES:-1}"
LOG_RANK="${LOG_RANK:-0}"

world=()  # --check-config checks the step shape for a fixed world size (not NNODES=min:max)
[[ "$NNODES" =~ ^[0-9]+$ ]] && world=(env WORLD_SIZE=$((NGPU * NNODES)))
for arg in "$@"; do
  case "$arg" in
    -h|--help|--help-all)
      cat <<'EOF'
usage: [VAR=value ...] ./run_train.sh [--check-config | --help-all] [--section.key VALUE ...]

Environment:
  CONFIG_FILE      train config (default: train_configs/debug_cpu.toml)
  NGPU             processes per node (default: the GPUs present, else 2 CPU processes)
  NNODES           nodes in the job (default 1)
  NODE_RANK        this node's rank (required when NNODES > 1)
  MASTER_ADDR      node 0's address, hosting the c10d rendezvous (MASTER_PORT, 29500)
  RDZV_ENDPOINT    a c10d rendezvous at another host:port (RDZV_ID, default sb_titan)
  MAX_RESTARTS     job restarts after a failed rank (default 3)
  LOG_RANK         the rank whose output is shown (default 0)
  OMP_NUM_THREADS  threads per CPU process (default 1)
  SB_FORK_RANKS    1: fork the ranks from one process that imported the trainer once
                   (default without a GPU), 0: fresh interpreters (default with GPUs)
  SB_TORCH_SPEC    the torch pip installs when .venv is first set up (default without an
                   NVIDIA GPU: torch==2.13.0, the CPU wheel)

EOF
      exec .venv/bin/python -m sb_titan.tools.train --config_file "$CONFIG_FILE" "$@" ;;
    --check-config)  # the checks alone, in one process: no lock, no torchrun
      exec "${world[@]}" .venv/bin/python -m sb_titan.tools.train --config_file "$CONFIG_FILE" "$@" ;;
  esac
done

MAX_RESTARTS="${MAX_RESTARTS:-3}"
if [ -n "${RDZV_ENDPOINT:-}" ]; then
  launch=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT"
          --rdzv_id="${RDZV_ID:-sb_titan}")
elif [ "$NNODES" -gt 1 ]; then
  # c10d (not static) rendezvous so restarts re-form the job; node 0 hosts the store.
  : "${NODE_RANK:?set NODE_RANK for multi-node}"
  is_host=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)
  launch=(--nnodes="$NNODES" --rdzv_backend=c10d
          --rdzv_endpoint="${MASTER_ADDR:?set MASTER_ADDR for multi-node}:${MASTER_PORT:-29500}"
          --rdzv_id="${RDZV_ID:-sb_titan}" --rdzv_conf="is_host=$is_host")
else
  launch=(--standalone)
fi

# torchrun, with what sb_titan/tools/launch.py adds: the checks and the dump folder's
# lock before any rank spawns (a problem is one line, exit 2), the cause of a failure
# once at the end (exit 3 for errors a restart would only repeat), and on CPU ranks
# forked from one process that imported the trainer once.
exec .venv/bin/python -m sb_titan.tools.launch "${launch[@]}" --nproc_per_node="$NGPU" \
  --max-restarts="$MAX_RESTARTS" --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -- --config_file "$CONFIG_FILE" "$@"
