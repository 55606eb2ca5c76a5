#!/usr/bin/env bash
# Runs kernels/flash_attn.cu's f32 and bf16 kernels on the CPU under a host emulation (no GPU, no
# CUDA install: g++ with C++20) and compares forward (O, lse) and backward (dQ, dK, dV) with a dense
# double-precision attention: causal GQA, MQA, sliding window 5 over 12, packed rows with a window,
# odd T, aligned and unaligned (scalar-load) buffers. Prints the relative error of each output and
# PASS/FAIL; exits non-zero on a failure.
#
# The emulation (scripts/flash-emu/): a block's threads are OS threads, __syncthreads / __syncwarp
# are barriers, __shfl_xor_sync goes through a per-warp slot array; wmma fragments hold the whole
# 16×16 tile in every lane (loads/stores fenced by warp barriers), with the layout semantics of
# nvcuda::wmma (row/column major, leading dimension). It checks the kernels' tiling, masking,
# online softmax, GQA indexing, loads and stores and the operand layouts of every tile product — not
# the real tensor-core fragments, shared-memory alignment, occupancy or speed (that needs a GPU:
# `rtune selftest`). The inline-asm shared-memory check is replaced by the emulated size, and the
# f16 instantiation (no host f16 conversion in the emulation) is left out.
#   scripts/flash-emu.sh        # 95 s wall, 10 s CPU at moderate load; 22 min wall at load 76
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
sed -e 's/asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));/have = emu_smem_bytes;/' \
  -e '/^FLASH_TYPE(__half/d' kernels/flash_attn.cu >"$out/fa.cpp"
grep -q 'have = emu_smem_bytes;' "$out/fa.cpp"
cp kernels/common.cuh "$out/"
g++ -std=c++20 -O1 -Iscripts/flash-emu/inc -Iscripts/flash-emu -I"$out" -include emu.h \
  -o "$out/harness" scripts/flash-emu/harness.cpp -lpthread
"$out/harness"
