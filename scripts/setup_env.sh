# Sourced by scripts/test.sh and scripts/demo.sh: `source scripts/setup_env.sh`.
#
# Finds a Python 3.12 interpreter, creates .venv in the repository root if missing, installs the runtime and build
# dependencies, builds te_jax in place (`pip install --no-build-isolation --no-deps -e .`: the CMake build, the CUDA
# module included when nvcc and cuBLASLt are found), then activates .venv. Idempotent and quick once set up: the
# dependency install is skipped while .venv/.te_deps holds the hash of the requirement list, and the build is skipped
# while .venv/.te_build holds the hash of the build inputs (pyproject.toml, CMakeLists.txt, ffi/). Python sources need
# no rebuild: the editable install imports them from the checkout.
#
# Not for the GPU machine, which has no network: scripts/gpu_check.sh installs into its system Python instead.

TE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TE_REQUIREMENTS=(
  "jax==0.11.2" "jaxlib==0.11.2" "flax==0.12.10" "optax==0.2.8" numpy ml_dtypes pytest
  scikit-build-core nanobind cmake ninja nvidia-cublas
)

# Prints the absolute path of a working Python 3.12 (pyenv shims exist for versions that are not selected, so each
# candidate is run, not just looked up).
_te_find_python() {
  local candidate exe
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12.*/bin/python3 "PYENV_VERSION=3.12.1 python3"; do
    exe="$(env $candidate -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' \
      2>/dev/null)" && [ -x "$exe" ] && { echo "$exe"; return 0; }
  done
  echo "setup: no Python 3.12 found (tried python3.12, ~/.pyenv/versions/3.12.*, PYENV_VERSION=3.12.1 python3)" >&2
  return 1
}

_te_hash() { sha256sum | cut -c1-16; }

# Runs in a subshell. Every step checks its own status: `set -e` would be ignored here, since the caller runs this
# function as an `if` condition.
_te_setup() (
  cd "$TE_ROOT" || exit 1
  venv="$TE_ROOT/.venv"
  if ! "$venv/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    py="$(_te_find_python)" || exit 1
    echo "setup: creating .venv with $py" >&2
    rm -rf "$venv" && "$py" -m venv "$venv" || exit 1
  fi
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)

  deps_hash="$(printf '%s\n' "${TE_REQUIREMENTS[@]}" | _te_hash)"
  if [ "$(cat "$venv/.te_deps" 2>/dev/null)" != "$deps_hash" ]; then
    echo "setup: installing dependencies into .venv (first run: a few minutes)" >&2
    "${pip[@]}" install -q "${TE_REQUIREMENTS[@]}" || exit 1
    echo "$deps_hash" > "$venv/.te_deps"
  fi

  build_hash="$( (cat pyproject.toml CMakeLists.txt && find ffi -type f | LC_ALL=C sort | xargs cat) | _te_hash)"
  if [ "$(cat "$venv/.te_build" 2>/dev/null)" != "$build_hash" ] \
      || ! "$venv/bin/python" -c 'import te_jax._te_cpu' 2>/dev/null; then
    echo "setup: building te_jax (CMake; log in .venv/te_build.log)" >&2
    if ! "${pip[@]}" install -v --no-build-isolation --no-deps -e . > "$venv/te_build.log" 2>&1; then
      tail -n 40 "$venv/te_build.log" >&2
      echo "setup: the build failed; full log in .venv/te_build.log" >&2
      exit 1
    fi
    grep -E "te_jax: (CUDA module|XLA FFI)" "$venv/te_build.log" | sed 's/^.*te_jax:/setup: cmake:/' >&2
    echo "$build_hash" > "$venv/.te_build"
  fi
)

if _te_setup; then
  # shellcheck disable=SC1091
  source "$TE_ROOT/.venv/bin/activate"
else
  echo "setup: failed" >&2
  return 1 2>/dev/null || exit 1
fi
