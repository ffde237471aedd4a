# Sourced by scripts/test.sh and scripts/demo.sh: `source scripts/setup_env.sh`.
#
# Finds a Python 3.12 interpreter, creates .venv in the repository root if missing, installs the runtime and build
# dependencies, builds te_jax in place (`pip install --no-build-isolation --no-deps -e .`), then activates .venv.
# Idempotent and quick once set up: the dependency install is skipped while .venv/.te_deps holds the hash of the
# requirement list, and the build is skipped while .venv/.te_build holds the hash of the build inputs (pyproject.toml,
# CMakeLists.txt, ffi/) and of the CUDA choice below. Python sources need no rebuild: the editable install imports them
# from the checkout. Both steps show their progress on stderr (pip's "Collecting" lines, the build's "[n/N]" lines);
# the full logs are .venv/te_deps.log and .venv/te_build.log.
#
# The CUDA module is built for the GPUs that nvidia-smi lists (CMakeLists.txt maps compute capabilities to
# architectures: 9.0 -> 90a-real, X.Y -> XY-real). Without a GPU only the CPU module is built: about 25 s on 2 cores,
# where compiling the CUDA kernels for the four architectures of a portable build took 13.5 minutes. To build the CUDA
# module anyway: TE_JAX_CUDA_ARCHS=90a-real (or a list: 80-real,90a-real), or TE_JAX_CUDA=ON (the GPUs present, else a
# portable set of architectures); TE_JAX_CUDA=OFF never builds it. A new GPU, another nvidia-smi answer or another value
# of these variables changes the build hash, so the next run rebuilds.
#
# Not for the GPU machine, which has no network: scripts/gpu_check.sh installs into its system Python instead.

TE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TE_REQUIREMENTS=(
  "jax==0.11.2" "jaxlib==0.11.2" "flax==0.12.10" "optax==0.2.8" numpy ml_dtypes pytest hypothesis
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

# _te_progress LOG LABEL REGEX: copies its input to LOG and shows the lines that match REGEX on stderr, with the
# seconds since it started, so that a step of several minutes says what it is doing. After 30 s without such a line
# it says that it is still at work (pip unpacks for ~30 s without a word; one CUDA source compiles for minutes).
_te_progress() {
  local log=$1 label=$2 regex=$3 start=$SECONDS last=$SECONDS line partial="" shown eof=0 got
  while ((!eof)); do
    got=1
    if IFS= read -r -t 5 line; then
      line="$partial$line" partial=""
    elif (($? > 128)); then  # timed out: keep what came of the line so far
      partial+="$line" line="" got=0
    else  # end of input, perhaps after an unterminated last line
      eof=1 line="$partial$line"
      [ -n "$line" ] || got=0
    fi
    ((got)) && printf '%s\n' "$line" >&3
    if ((got)) && [[ $line =~ $regex ]]; then
      shown="${line#"${line%%[![:space:]]*}"}"
      # "[3/19] Building CXX object CMakeFiles/_te_cpu.dir/ffi/cpu/norm.cc.o" -> "[3/19] CXX ffi/cpu/norm.cc"
      if [[ $shown =~ ^(\[[0-9]+/[0-9]+\])\ Building\ ([A-Z]+)\ object\ CMakeFiles/[^/]+\.dir/(.*)\.o$ ]]; then
        shown="${BASH_REMATCH[1]} ${BASH_REMATCH[2]} ${BASH_REMATCH[3]##*site-packages/}"
      fi
      ((${#shown} <= 150)) || shown="${shown:0:147}..."
      printf 'setup: %s %4ss: %s\n' "$label" "$((SECONDS - start))" "$shown" >&2
      last=$SECONDS
    elif ((!eof && SECONDS - last >= 30)); then
      printf 'setup: %s %4ss: ... still at work\n' "$label" "$((SECONDS - start))" >&2
      last=$SECONDS
    fi
  done 3>"$log"
}

# Runs in a subshell. Every step checks its own status: `set -e` would be ignored here, since the caller runs this
# function as an `if` condition.
_te_setup() (
  cd "$TE_ROOT" || exit 1
  export PYTHONUNBUFFERED=1  # pip's lines as they come, not in 8 KiB blocks
  venv="$TE_ROOT/.venv"
  if ! "$venv/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    py="$(_te_find_python)" || exit 1
    echo "setup: creating .venv with $py" >&2
    rm -rf "$venv" && "$py" -m venv "$venv" || exit 1
  fi
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)

  deps_hash="$(printf '%s\n' "${TE_REQUIREMENTS[@]}" | _te_hash)"
  if [ "$(cat "$venv/.te_deps" 2>/dev/null)" != "$deps_hash" ]; then
    echo "setup: installing dependencies into .venv (first run: a few minutes; log in .venv/te_deps.log)" >&2
    "${pip[@]}" install --progress-bar off "${TE_REQUIREMENTS[@]}" 2>&1 \
      | _te_progress "$venv/te_deps.log" pip '^(Collecting|Installing collected|Successfully installed|ERROR)'
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
      tail -n 20 "$venv/te_deps.log" >&2
      echo "setup: the dependency install failed; full log in .venv/te_deps.log" >&2
      exit 1
    fi
    echo "$deps_hash" > "$venv/.te_deps"
  fi

  # What decides whether and for what the CUDA module is built (CMakeLists.txt decides; these are its inputs), passed
  # to CMake explicitly on every build so that no value lingers in the CMake cache of build/. Semicolons in the
  # architecture list become commas: SKBUILD_CMAKE_DEFINE splits at semicolons.
  archs="${TE_JAX_CUDA_ARCHS:-}" mode="${TE_JAX_CUDA:-AUTO}"
  mode="${mode^^}"
  cuda_define="TE_JAX_CUDA=$mode;TE_JAX_CUDA_ARCHS=${archs//;/,}"
  gpus="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null)" || gpus=""
  gpus="$(printf '%s\n' "$gpus" | LC_ALL=C sort -u | paste -sd, | sed 's/^,//')"
  cuda_inputs="$cuda_define gpus=$gpus nvcc=$(command -v nvcc) CUDACXX=${CUDACXX:-}"
  cuda_inputs+=" SKBUILD_CMAKE_DEFINE=${SKBUILD_CMAKE_DEFINE:-} SKBUILD_CMAKE_ARGS=${SKBUILD_CMAKE_ARGS:-}"
  build_hash="$( (echo "$cuda_inputs" && cat pyproject.toml CMakeLists.txt \
    && find ffi -type f | LC_ALL=C sort | xargs cat) | _te_hash)"
  if [ "$(cat "$venv/.te_build" 2>/dev/null)" != "$build_hash" ] \
      || ! "$venv/bin/python" -c 'import te_jax._te_cpu' 2>/dev/null; then
    note="CPU module"
    if [ "$mode" != OFF ] && { [ -n "$archs$gpus" ] || [ "$mode" = ON ]; }; then
      note="CPU module, and the CUDA module if nvcc and cuBLASLt are found: ~6 minutes per architecture on 2 cores"
    fi
    echo "setup: building te_jax (${gpus:+GPU compute capability $gpus; }$note; log in .venv/te_build.log)" >&2
    SKBUILD_CMAKE_DEFINE="$cuda_define${SKBUILD_CMAKE_DEFINE:+;$SKBUILD_CMAKE_DEFINE}" \
      "${pip[@]}" install -v --no-build-isolation --no-deps -e . 2>&1 \
      | _te_progress "$venv/te_build.log" build '^[[:space:]]*(\[[0-9]+/[0-9]+\] |-- te_jax:|CMake Error)'
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
      tail -n 40 "$venv/te_build.log" >&2
      echo "setup: the build failed; full log in .venv/te_build.log" >&2
      exit 1
    fi
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
