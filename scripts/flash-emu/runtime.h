// The emulated device's state and synchronisation (one definition, included once by each harness:
// harness.cpp for flash_attn.cu, kernels_lib.cpp for the other kernels): the launch indices, the
// block's barrier and each warp's, and the warp shuffles through a slot array (a lane reads its
// partner's slot between two warp barriers, before it can reach the next shuffle's first one).
#pragma once
#include <barrier>
#include <memory>

thread_local dim3e threadIdx;
dim3e blockIdx, gridDim, blockDim;
unsigned emu_smem_bytes;

static std::unique_ptr<std::barrier<>> block_bar, warp_bar[32];
static float slot[32][32];
void __syncthreads() { block_bar->arrive_and_wait(); }
void __syncwarp() { warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
static float exchange(float v, int from) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    warp_bar[w]->arrive_and_wait();
    slot[w][l] = v;
    warp_bar[w]->arrive_and_wait();
    return slot[w][from & 31];
}
float __shfl_xor_sync(unsigned, float v, int o) { return exchange(v, (threadIdx.x % 32) ^ o); }
float __shfl_sync(unsigned, float v, int src) { return exchange(v, src); }

// A block starts: fresh barriers for `blockDim.x` threads.
static void emu_new_block() {
    block_bar = std::make_unique<std::barrier<>>(blockDim.x);
    for (unsigned w = 0; w < blockDim.x / 32; ++w) warp_bar[w] = std::make_unique<std::barrier<>>(32);
}
