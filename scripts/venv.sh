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
  # the recipe imports ~2,100 of them. Those are compiled below, by importing them once.
  local pip=("$root/.venv/bin/python" -m pip install --disable-pip-version-check -q --no-compile)
  local torch_spec="${SB_TORCH_SPEC:-}"
  if [ -z "$torch_spec" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    torch_spec="torch==2.13.0"
  fi
  if [ -n "$torch_spec" ]; then
    "${pip[@]}" "$torch_spec"
  fi
  "${pip[@]}" -e "$root[test,eval]"
  # The bytecode pip skipped, for what training imports (written even where
  # PYTHONDONTWRITEBYTECODE is set, as pip's own compile step would be).
  PYTHONDONTWRITEBYTECODE='' "$root/.venv/bin/python" -c \
    "import sb_titan.config.defaults, sb_titan.runtime.trainer, sb_titan.tools.launch"
  echo "$stamp" > "$marker"
}
