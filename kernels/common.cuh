// Shared device helpers of rtune's kernels (included by fused.cu and attn.cu): element conversions
// (f32, bf16, f16 to and from f32), 16-byte vector loads and stores, and block sums. Not compiled
// on its own (build.rs and scripts/check-kernels.sh compile kernels/*.cu).

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// ---------------------------------------------------------------------------------------------
// Element conversions and 16-byte vectors

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

// The value an intermediate tensor of type T holds (ops.rs's `.to_dtype(T)` or a T-typed product).
template <typename T> __device__ __forceinline__ float round_t(float x) { return to_f32(from_f32<T>(x)); }

__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint32_t bits16(__half x) { return __half_as_ushort(x); }

// Elements per 16-byte vector.
template <typename T> struct Vec { static constexpr int N = 16 / sizeof(T); };

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__device__ __forceinline__ void unpack(const uint4 r, float* v, const float*) {
    v[0] = __uint_as_float(r.x); v[1] = __uint_as_float(r.y);
    v[2] = __uint_as_float(r.z); v[3] = __uint_as_float(r.w);
}
// Little-endian: element 2i is the low half of word i. bf16 -> f32 is a shift.
__device__ __forceinline__ void unpack(const uint4 r, float* v, const __nv_bfloat16*) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void unpack(const uint4 r, float* v, const __half*) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
        v[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
    }
}

// Loads Vec<T>::N elements from a 16-byte aligned, read-only p.
template <typename T> __device__ __forceinline__ void load_vec(const T* p, float* v) {
    unpack(__ldg(reinterpret_cast<const uint4*>(p)), v, p);
}

__device__ __forceinline__ void store_vec(float* p, const float* v) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
template <typename T> __device__ __forceinline__ void store_vec(T* p, const float* v) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = bits16(from_f32<T>(v[2 * i])) | (bits16(from_f32<T>(v[2 * i + 1])) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// K consecutive elements: one 16-byte vector (K = Vec<T>::N, p aligned) or one scalar (K = 1).
template <int K, typename T> __device__ __forceinline__ void load_k(const T* p, float* v) {
    if constexpr (K == 1) v[0] = to_f32(*p); else load_vec(p, v);
}
// K consecutive elements of a read-only W whose vector width may differ from K (an f32 weight or
// RoPE table beside bf16/f16 data: K = 8 is two f32 vectors): K / Vec<W>::N vectors, or one scalar.
template <int K, typename W> __device__ __forceinline__ void load_kw(const W* p, float* v) {
    if constexpr (K == 1 || K == Vec<W>::N) {
        load_k<K>(p, v);
    } else {
        static_assert(K % Vec<W>::N == 0, "K is a whole number of W vectors");
#pragma unroll
        for (int j = 0; j < K; j += Vec<W>::N) load_vec(p + j, v + j);
    }
}
// load_k for a buffer the kernel also writes (in-place RoPE, an accumulated gradient): a plain
// load, not __ldg (the read-only cache is only for data no thread of the launch writes).
template <int K, typename T> __device__ __forceinline__ void load_k_rw(const T* p, float* v) {
    if constexpr (K == 1) v[0] = to_f32(*p); else unpack(*reinterpret_cast<const uint4*>(p), v, p);
}
template <int K, typename T> __device__ __forceinline__ void store_k(T* p, const float* v) {
    if constexpr (K == 1) *p = from_f32<T>(v[0]); else store_vec(p, v);
}

// ---------------------------------------------------------------------------------------------
// Block reductions (blockDim.x a multiple of 32, <= 1024). Every thread gets the result.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sums a and b over the block. scratch: 2 x 32 floats of shared memory.
__device__ __forceinline__ float2 block_sum2(float a, float b, float* scratch) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();  // the previous row's readers are done with scratch
    if (lane == 0) {
        scratch[warp] = a;
        scratch[32 + warp] = b;
    }
    __syncthreads();
    a = lane < warps ? scratch[lane] : 0.0f;
    b = lane < warps ? scratch[32 + lane] : 0.0f;
    return make_float2(warp_sum(a), warp_sum(b));
}
