// rtune's own kernels but flash attention (kernels/fused.cu, attn.cu, adamw.cu, nf4.cu, dropout.cu;
// flash_attn.cu has its own harness, scripts/flash-emu.sh) built for the host as a shared library
// under the emulation of emu.h and runtime.h: crates/ops/tests/kernels_emulated.rs compiles it with
// g++ (-DEMU_STATIC_SHARED; attn.cu's `extern __shared__` patched to a plain `extern`, the dynamic
// shared array below), loads it and launches each kernel: the test's threads are a block's
// threads, one block after another. What it checks: every kernel's indexing, masking, vector and
// scalar paths, reductions and roundings against the ops' references, on the CPU; not the real
// warp scheduling, occupancy or speed (`rtune selftest` on a GPU).
#include "emu.h"
#include "fused.cu"
#include "attn_emu.cu"  // kernels/attn.cu, patched by the test
#include "adamw.cu"
#include "nf4.cu"
#include "dropout.cu"

#include "runtime.h"

// attn.cu's dynamic shared memory (`cache`: t floats), 16-byte aligned.
__attribute__((aligned(16))) float cache[1 << 16];

// The launch: a grid of `gx` blocks of `threads` threads (a multiple of 32, at most 1024).
extern "C" void emu_grid(unsigned gx, unsigned threads) {
    gridDim = {gx, 1, 1};
    blockDim = {threads, 1, 1};
}
// Block `bx` starts: fresh barriers, shared memory garbage as on a GPU.
extern "C" void emu_block(unsigned bx) {
    blockIdx = {bx, 0, 0};
    memset(cache, 0xcd, sizeof cache);
    emu_new_block();
}
// The calling OS thread is thread `t` of the current block.
extern "C" void emu_thread(unsigned t) { threadIdx = {t, 0, 0}; }
