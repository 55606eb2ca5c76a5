// LoRA dropout on the GPU: y = f32(x) · m(i), m(i) = 1/(1−p) if element i is kept, else 0, with the
// mask drawn from Philox4x32-10 (Salmon et al., SC 2011; Random123's philox4x32) exactly as
// crates/backend/src/dropout.rs does on the CPU, so both devices draw the same masks:
//   key     (seed low, seed high)           the micro-batch seed
//   counter (i/4 low, i/4 high, salt low, salt high)   salt: the layer and module
//   keep    (word[i % 4] >> 8) >= threshold  threshold = ceil(p · 2^24), computed on the host
// One thread per Philox block (4 consecutive elements), grid-stride. The product is one IEEE f32
// multiply (no FMA to contract), so y is bit-identical to the CPU's.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float dropout_to_f32(float x) { return x; }
__device__ __forceinline__ float dropout_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float dropout_to_f32(__half x) { return __half2float(x); }

// Philox4x32 with 10 rounds (Random123's philox4x32_R(10, ...)).
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k.x += 0x9E3779B9u;
            k.y += 0xBB67AE85u;
        }
        const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

template <typename T>
__device__ __forceinline__ void lora_dropout(const T* __restrict__ x, float* __restrict__ y,
                                             unsigned long long n, uint32_t seed_lo,
                                             uint32_t seed_hi, uint32_t salt_lo, uint32_t salt_hi,
                                             uint32_t threshold, float scale) {
    const unsigned long long blocks = (n + 3) / 4;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long b = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; b < blocks;
         b += step) {
        const uint4 w = philox4x32_10(
            make_uint4((uint32_t)b, (uint32_t)(b >> 32), salt_lo, salt_hi), make_uint2(seed_lo, seed_hi));
        const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned long long i = b * 4 + j;
            if (i < n) {
                const float m = (words[j] >> 8) >= threshold ? scale : 0.0f;
                y[i] = __fmul_rn(dropout_to_f32(x[i]), m);
            }
        }
    }
}

#define LORA_DROPOUT(SUFFIX, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(256) lora_dropout_##SUFFIX(                        \
        const T* __restrict__ x, float* __restrict__ y, unsigned long long n, uint32_t seed_lo,     \
        uint32_t seed_hi, uint32_t salt_lo, uint32_t salt_hi, uint32_t threshold, float scale) {    \
        lora_dropout<T>(x, y, n, seed_lo, seed_hi, salt_lo, salt_hi, threshold, scale);             \
    }

LORA_DROPOUT(f32, float)
LORA_DROPOUT(bf16, __nv_bfloat16)
LORA_DROPOUT(f16, __half)
