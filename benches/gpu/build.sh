#!/usr/bin/env bash
# benches/gpu/build.sh — builds the CUDA rtune on this (GPU-less) machine and puts it, stripped, at
# benches/gpu/bin/rtune (git-ignored) for `run` calls to carry (README.md here).
#
# The CUDA 13.0 toolchain comes from PyPI wheels (../shared/cuda/toolchain.sh: nvcc, cudart, cublas,
# curand, nvrtc and a link-time libcuda stub); sm_90 = Hopper (H100/H200). A clean build takes ~25 min
# on 2 cores; the separate target dir keeps it from invalidating the CPU build in target/.
# Debug info off: the binary must fit the 64 MiB a call carries, with the wheels and the tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(../shared/cuda/toolchain.sh)"
# cuDNN's fused attention shim (kernels/cudnn_sdpa.cpp): its headers; cuDNN itself is loaded at run time.
eval "$(scripts/cudnn-headers.sh)"
export RTUNE_CUDNN_INCLUDE
export CUDA_COMPUTE_CAP=90
# The data-parallel NCCL path (crates/dist/src/nccl.rs) links libnccl: NVIDIA's wheel gives it for
# the link here; on the H200 run.sh points LD_LIBRARY_PATH at torch's own copy.
venv=${RTUNE_CUDA_HOME:-$HOME/.cache/rtune-cuda}/venv
nccl=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/nccl/lib 2>/dev/null | head -1 || true)
if [ -z "$nccl" ]; then
  "$venv/bin/pip" install -q "nvidia-nccl-cu13==2.*" >&2
  nccl=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/nccl/lib | head -1)
fi
[ -e "$nccl/libnccl.so" ] || ln -sf libnccl.so.2 "$nccl/libnccl.so"
export LIBRARY_PATH="$nccl${LIBRARY_PATH:+:$LIBRARY_PATH}"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --features cuda --bin rtune
mkdir -p benches/gpu/bin
cp "$CARGO_TARGET_DIR/release/rtune" benches/gpu/bin/rtune
strip benches/gpu/bin/rtune
# What the H200 machine must provide at run time (run.sh points LD_LIBRARY_PATH at torch's copies).
readelf -d benches/gpu/bin/rtune | awk '/NEEDED/ {print "needs", $NF}'
# Newest glibc symbol it uses: must not exceed the H200 image's glibc (its python 3.12.3 suggests Ubuntu
# 24.04, glibc 2.39; this machine builds against 2.36). run.sh prints unresolved libraries there.
objdump -T benches/gpu/bin/rtune | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 | sed 's/^/glibc needed: /'
stat -c %s benches/gpu/bin/rtune | awk '{printf "benches/gpu/bin/rtune: %.1f MB\n", $1 / 1e6}'
# Stripped it is still ~63 MB (candle's PTX for every kernel): it travels xz-compressed (~9 MB) and
# run.sh unpacks it with Python's lzma.
xz -T0 -6 -f benches/gpu/bin/rtune
stat -c %s benches/gpu/bin/rtune.xz | awk '{printf "benches/gpu/bin/rtune.xz: %.1f MB\n", $1 / 1e6}'
# .whl/ is there only once fetch-wheels.sh has run (a fresh clone has none): du is given what exists,
# since a missing path makes it exit 1, which pipefail turns into this script's failure.
carried=(benches/gpu/bin)
[ ! -d .whl ] || carried+=(.whl)
du -cb "${carried[@]}" | tail -1 | awk -v what="${carried[*]}" \
  '{printf "carried (%s): %.1f MB; with the tree (~9 MB) it must stay under 64 MiB\n", what, $1 / 1e6}'
