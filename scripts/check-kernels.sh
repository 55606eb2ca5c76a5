#!/usr/bin/env bash
# Compiles every kernels/*.cu with nvcc, warnings as errors, and fails on any error:
#   - to PTX for compute_90 and compute_80 (what crates/backend/build.rs embeds), and
#   - through ptxas to SASS for sm_90 and sm_80 (catches what only the assembler sees).
# Needs no GPU and no CUDA install: nvcc, cicc, ptxas and the headers come from NVIDIA's PyPI wheels
# (CUDA 13.0, ~300 MB), installed once into $RTUNE_NVCC_HOME (default ~/.cache/rtune-nvcc).
# Measured on the 2-core dev machine (shared, load ~9): 63 s from a clean cache, 3-15 s warm.
# Also kernels/cudnn_sdpa.cpp (cuDNN's fused attention through cudnn-frontend, issue 48) with the
# host g++, warnings as errors, against the headers of scripts/cudnn-headers.sh (cached in
# ~/.cache/rtune-cudnn: ~10 s once, nothing warm): with --cargo inside `cargo clippy -D warnings` (build.rs
# compiles it when RTUNE_CUDNN_INCLUDE is set), else alone (-fsyntax-only). The front end's headers
# make it the slowest file: ~47 CPU-s, 30 s to 2 min wall on the loaded dev box.
#
#   scripts/check-kernels.sh            # the .cu files only
#   scripts/check-kernels.sh --cargo    # also `cargo check -p rtune-backend -p rtune-ops --tests`
#                                       # with their `kernels` feature (the launchers and checks)
#                                       # (cudarc + build.rs with this nvcc; ~3 CPU-min from a
#                                       # clean target dir, 6 min wall on the loaded dev box; ~40 s warm)
set -euo pipefail
cd "$(dirname "$0")/.."
home=${RTUNE_NVCC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/rtune-nvcc}
find_cu() { ls -d "$home"/venv/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -1 || true; }
cu=$(find_cu)
if [ -z "$cu" ] || [ ! -x "$cu/bin/nvcc" ] || [ ! -x "$cu/nvvm/bin/cicc" ] \
  || [ ! -d "$cu/include/nv" ]; then
  echo "check-kernels: installing nvcc 13.0 from PyPI into $home" >&2
  python3 -m venv "$home/venv"
  "$home/venv/bin/pip" install -q --disable-pip-version-check \
    "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*"
  cu=$(find_cu)
fi
export PATH="$cu/bin:$PATH" CUDA_ROOT="$cu" CUDA_PATH="$cu"
nvcc=$cu/bin/nvcc
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=(-O3 -std=c++17 -Werror all-warnings)
shopt -s nullglob
sources=(kernels/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "check-kernels: no kernels/*.cu" >&2
  exit 1
fi
for f in "${sources[@]}"; do
  stem=$(basename "$f" .cu)
  for arch in 90 80; do
    "$nvcc" "${flags[@]}" --ptx -arch="compute_$arch" -o "$out/$stem.$arch.ptx" "$f"
    "$nvcc" "${flags[@]}" --cubin -arch="sm_$arch" -Xptxas -Werror -o "$out/$stem.$arch.cubin" "$f"
  done
  echo "check-kernels: $f ok (compute/sm 90, 80)"
done
eval "$(scripts/cudnn-headers.sh)"
if [ "${1:-}" != "--cargo" ]; then
  inc=()
  IFS=: read -ra dirs <<<"$RTUNE_CUDNN_INCLUDE"
  for d in "${dirs[@]}" "$cu/include"; do inc+=(-isystem "$d"); done
  "${CXX:-c++}" -std=c++17 -fsyntax-only -Wall -Wextra -Werror "${inc[@]}" kernels/cudnn_sdpa.cpp
  echo "check-kernels: kernels/cudnn_sdpa.cpp ok (host C++, cudnn-frontend)"
fi
if [ "${1:-}" = "--cargo" ]; then
  export RTUNE_CUDNN_INCLUDE
  # clippy checks as `cargo check` does, and keeps the kernels-only code lint-clean too.
  cargo clippy -p rtune-backend -p rtune-ops --features rtune-backend/kernels,rtune-ops/kernels \
    --tests --benches --locked -- -D warnings
  echo "check-kernels: cargo clippy -p rtune-backend -p rtune-ops --features kernels ok" \
    "(with kernels/cudnn_sdpa.cpp)"
fi
