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

CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_cpu.toml}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  NGPU="${NGPU:-$(nvidia-smi -L | wc -l)}"
else
  NGPU="${NGPU:-2}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # CPU: one thread per process
fi
NNODES="${NNODES:-1}"
LOG_RANK="${LOG_RANK:-0}"

world=()  # the step shape is checked for a fixed world size (not for NNODES=min:max)
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
  SB_TORCH_SPEC    the torch pip installs when .venv is first set up (default without an
                   NVIDIA GPU: torch==2.13.0, the CPU wheel)

EOF
      exec .venv/bin/python -m sb_titan.tools.train --config_file "$CONFIG_FILE" "$@" ;;
    --check-config)  # the checks alone, in one process: no lock, no torchrun
      exec "${world[@]}" .venv/bin/python -m sb_titan.tools.train --config_file "$CONFIG_FILE" "$@" ;;
  esac
done

MAX_RESTARTS="${MAX_RESTARTS:-3}"
export MAX_RESTARTS SB_LAUNCHER=run_train.sh
# Workers get a fresh TCPStore per attempt: the agent's shared one keeps the previous
# attempt's keys, and a restarted rank can read a dead peer's address from it (gloo
# "connectFullMesh ... Connection refused", or a hang; pytorch/pytorch#135712, #167288).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

# One run per dump folder (sb_titan/util/run_lock.py): --prelaunch takes the folder's
# lock for this script before any rank spawns; the ranks share it through this token
# (the same on every node of a multi-node job); it is released when the script exits.
if [ -n "${RDZV_ENDPOINT:-}" ] || [ "$NNODES" != 1 ]; then
  token="rdzv:${RDZV_ID:-sb_titan}@${RDZV_ENDPOINT:-${MASTER_ADDR:-}:${MASTER_PORT:-29500}}"
else
  token="$(hostname):$$:$(date +%s%N):$RANDOM"
fi
export SB_RUN_TOKEN="${SB_RUN_TOKEN:-$token}" SB_LAUNCHER_PID=$$

# Fail fast, once, with one clear line on a bad config, profile, dataset or checkpoint
# (before spawning ranks; sb_titan/config/preflight.py); warn about restarts without
# checkpoints; learn where a rank records the error that stopped it.
fatal_file="$("${world[@]}" .venv/bin/python -m sb_titan.tools.train \
  --prelaunch --config_file "$CONFIG_FILE" "$@" | tail -n 1)"
dump_folder="$(dirname "$fatal_file")"
trap '.venv/bin/python -m sb_titan.util.run_lock release "$dump_folder" || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

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

rc=0
.venv/bin/torchrun "${launch[@]}" --nproc_per_node="$NGPU" --max-restarts="$MAX_RESTARTS" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m sb_titan.tools.train --config_file "$CONFIG_FILE" "$@" || rc=$?

# A rank hit an error that restarts would only repeat (config, data, profile): the next
# attempt's ranks stopped at once; report the recorded cause and fail.
cause() { .venv/bin/python -c 'import json, sys; r = json.load(open(sys.argv[1])); print("%s (rank %s, attempt %s)" % (r["cause"], r["rank"], r["attempt"]))' "$1"; }
if [ -s "$fatal_file" ]; then
  echo "sb_titan: not retried: $(cause "$fatal_file")" >&2
  exit 3
fi
# Any other failure ends the output with its cause once (the tracebacks are above).
failure_file="$dump_folder/last_failure.json"
if [ "$rc" -ne 0 ]; then
  if [ -s "$failure_file" ]; then
    echo "sb_titan: failed: $(cause "$failure_file")" >&2
  else
    echo "sb_titan: failed: a rank exited with status $rc without a Python error (killed?)" >&2
  fi
fi
exit "$rc"
