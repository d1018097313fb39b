# Sourced by run_train.sh and run_tests.sh: create/refresh .venv with what the recipe needs.
# torch is installed first: pinned to the CPU wheel on machines without an NVIDIA GPU
# (an unpinned torch would pull a multi-GB CUDA build); with a GPU, pyproject's range
# lets pip pick the CUDA build. Override with SB_TORCH_SPEC="torch==X".
sb_ensure_venv() {
  local root marker stamp py
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  marker="$root/.venv/.sb_titan_deps"
  stamp="$(sha1sum "$root/pyproject.toml" | cut -d' ' -f1)"
  if [ -x "$root/.venv/bin/python" ] && [ -f "$marker" ] && [ "$(cat "$marker")" = "$stamp" ]; then
    return 0
  fi
  py="$(command -v python3.11 || command -v python3)"
  echo "sb_titan: setting up $root/.venv with $($py --version)" >&2
  [ -x "$root/.venv/bin/python" ] || "$py" -m venv "$root/.venv"
  # --no-compile: pip would compile every installed file to bytecode (~15,000 files,
  # ~90 CPU s on a 2-core machine; transformers, sympy and pandas are half of it), while
  # the recipe imports ~2,100 of them. Those are compiled as they are first imported
  # (sb_warm_bytecode below).
  local pip=("$root/.venv/bin/python" -m pip install --disable-pip-version-check -q --no-compile)
  local torch_spec="${SB_TORCH_SPEC:-}"
  if [ -z "$torch_spec" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    torch_spec="torch==2.13.0"
  fi
  if [ -n "$torch_spec" ]; then
    "${pip[@]}" "$torch_spec"
  fi
  "${pip[@]}" -e "$root[test,eval]"
  rm -f "$root/.venv/.sb_titan_bytecode"
  echo "$stamp" > "$marker"
}

# The bytecode pip skipped, for what training imports. A process writes the bytecode of
# what it imports, so the first run compiles it, unless PYTHONDONTWRITEBYTECODE is set:
# then every process of every run would compile it again (~20 CPU s each), and it is
# written here once, by importing it. (run_tests.sh lets the suite's processes write it.)
sb_warm_bytecode() {
  local root done
  [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] || return 0
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  done="$root/.venv/.sb_titan_bytecode"
  [ -f "$done" ] && return 0
  PYTHONDONTWRITEBYTECODE='' "$root/.venv/bin/python" -c \
    "import sb_titan.config.defaults, sb_titan.runtime.trainer, sb_titan.tools.launch"
  touch "$done"
}
