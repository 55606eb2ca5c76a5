// NF4 / FP4 dequantization (bitsandbytes layout), to f32, f16 or bf16.
//
// Reference: the NF4 op's CPU dequant (crates/ops/src/nf4/cpu.rs); crates/ops/tests compares
// the two bit for bit. Layout: element 2i is the HIGH nibble of packed[i], 2i+1 the low nibble; one
// scale per block of 64 consecutive elements (bitsandbytes' blocksize, the only one rtune reads).
//   out[e] = round_to_T(quant_map[code[e]] * absmax[e / 64])                  (f32 multiply)
// With double quantization the scale is first decoded as bitsandbytes does on the CPU:
//   absmax[b] = nested_map[codes[b]] * nested_absmax[b / nested_blocksize] + offset
// with two separate roundings (__fmul_rn / __fadd_rn: nvcc would otherwise fuse them into an FMA and
// differ from bitsandbytes and the CPU in the last bit).
//
// Work split, for bandwidth: one thread = 8 packed bytes = 16 outputs, all inside one 64-element
// block; one 8-byte load, then 16-byte stores (4 for f32, 2 for f16/bf16). The 4 threads of a block
// are adjacent lanes of a warp: the first decodes the scale once and shuffles it to the other three.
// Launch: blockDim.x a multiple of 32, grid = ceil(n / (16 * blockDim.x)); buffers from cudaMalloc
// (256-byte aligned) so every vector access is aligned.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define NF4_BLOCK 64
#define PER_THREAD 16

struct PlainScale {
    const float* __restrict__ absmax;  // [n_blocks]
    __device__ __forceinline__ float operator()(long long b) const { return __ldg(absmax + b); }
};

struct DoubleScale {
    const uint8_t* __restrict__ codes;         // [n_blocks]
    const float* __restrict__ nested_absmax;   // [ceil(n_blocks / nested_blocksize)]
    const float* __restrict__ nested_map;      // [256]
    float offset;
    int nested_blocksize;
    __device__ __forceinline__ float operator()(long long b) const {
        const float q = __fmul_rn(__ldg(nested_map + __ldg(codes + b)),
                                  __ldg(nested_absmax + b / nested_blocksize));
        return __fadd_rn(q, offset);
    }
};

// Writes 16 consecutive outputs from the f32 products v[0..16).
__device__ __forceinline__ void store16(float* dst, const float* v) {
    float4* p = reinterpret_cast<float4*>(dst);
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}

__device__ __forceinline__ uint32_t pack2(__half a, __half b) {
    return (uint32_t)__half_as_ushort(a) | ((uint32_t)__half_as_ushort(b) << 16);
}
__device__ __forceinline__ uint32_t pack2(__nv_bfloat16 a, __nv_bfloat16 b) {
    return (uint32_t)__bfloat16_as_ushort(a) | ((uint32_t)__bfloat16_as_ushort(b) << 16);
}
__device__ __forceinline__ __half to_out(float x, __half*) { return __float2half_rn(x); }
__device__ __forceinline__ __nv_bfloat16 to_out(float x, __nv_bfloat16*) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float to_out(float x, float*) { return x; }

template <typename T>
__device__ __forceinline__ void store16(T* dst, const float* v) {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = pack2(to_out(v[2 * i], dst), to_out(v[2 * i + 1], dst));
    uint4* p = reinterpret_cast<uint4*>(dst);
    p[0] = make_uint4(w[0], w[1], w[2], w[3]);
    p[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// packed: [ceil(n/2)]  quant_map: [16]  out: [n]. `block`: this CUDA block's index within the
// tensor (blockIdx.x for one tensor a launch; the grouped kernel's block minus its entry's start).
template <typename T, typename Scale>
__device__ __forceinline__ void dequant(const uint8_t* __restrict__ packed, const Scale scale,
                                        const float* __restrict__ quant_map, T* __restrict__ out,
                                        long long n, long long block) {
    __shared__ float table[16];
    if (threadIdx.x < 16) table[threadIdx.x] = quant_map[threadIdx.x];
    __syncthreads();

    const long long e0 = (block * blockDim.x + threadIdx.x) * PER_THREAD;
    const unsigned lane = threadIdx.x & 31;
    float s = 0.0f;
    if ((lane & 3) == 0 && e0 < n) s = scale(e0 / NF4_BLOCK);
    s = __shfl_sync(0xffffffffu, s, lane & ~3u);  // every lane of the warp reaches this
    if (e0 >= n) return;

    float v[PER_THREAD];
    if (e0 + PER_THREAD <= n) {
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(packed + e0 / 2));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t byte = ((i < 4 ? raw.x : raw.y) >> (8 * (i & 3))) & 0xffu;
            v[2 * i] = __fmul_rn(table[byte >> 4], s);
            v[2 * i + 1] = __fmul_rn(table[byte & 15u], s);
        }
        store16(out + e0, v);
    } else {  // the last, partial group of the tensor
        for (long long e = e0; e < n; ++e) {
            const uint8_t byte = packed[e / 2];
            const unsigned code = (e & 1) ? (byte & 15u) : (byte >> 4);
            out[e] = to_out(__fmul_rn(table[code], s), out);
        }
    }
}

#define NF4_KERNELS(SUFFIX, T)                                                                     \
    extern "C" __global__ void nf4_dequant_plain_##SUFFIX(                                         \
        const uint8_t* __restrict__ packed, const float* __restrict__ absmax,                      \
        const float* __restrict__ quant_map, T* __restrict__ out, long long n) {                   \
        dequant<T>(packed, PlainScale{absmax}, quant_map, out, n, blockIdx.x);                     \
    }                                                                                              \
    extern "C" __global__ void nf4_dequant_double_##SUFFIX(                                        \
        const uint8_t* __restrict__ packed, const uint8_t* __restrict__ codes,                     \
        const float* __restrict__ nested_absmax, const float* __restrict__ nested_map,             \
        float offset, int nested_blocksize, const float* __restrict__ quant_map,                   \
        T* __restrict__ out, long long n) {                                                        \
        dequant<T>(packed, DoubleScale{codes, nested_absmax, nested_map, offset, nested_blocksize}, \
                   quant_map, out, n, blockIdx.x);                                                 \
    }

NF4_KERNELS(f32, float)
NF4_KERNELS(f16, __half)
NF4_KERNELS(bf16, __nv_bfloat16)

// Grouped dequantization (issue 48, item 4): several weights (a layer's q/k/v, or gate/up) in ONE
// launch into one output buffer, each at its own offset. The table travels by value as the
// kernel's parameter (no device copy; 8 entries = 648 bytes of the 4 KiB parameter space); its
// layout is mirrored by `rtune_ops::nf4::group::GroupEntry` (80 bytes, checked on both sides).
// Entry i owns CUDA blocks [block_start[i], block_start[i+1]) (prefix sums of ceil(n / (16 *
// blockDim.x)), made by the launcher for its blockDim); a block finds its entry by a scan of at
// most 8 starts and then runs exactly the one-tensor kernel's body on it, so the outputs are
// those of the per-tensor kernels bit for bit. Each out_offset is a multiple of 256 bytes (the
// plan's alignment), so the 16-byte stores stay aligned. Entries may mix plain and double-quant
// scales and NF4/FP4 tables: all of that is per entry, uniform within a block.
#define NF4_GROUP_MAX 8

struct Nf4GroupEntry {
    const uint8_t* packed;        // [ceil(n/2)]
    const float* absmax;          // plain: [n_blocks]; double: unused (null)
    const uint8_t* codes;         // double: [n_blocks]; plain: null
    const float* nested_absmax;   // double: [ceil(n_blocks / nested_blocksize)]
    const float* nested_map;      // double: [256]
    const float* quant_map;       // [16]
    long long n;                  // elements
    long long out_offset;         // elements into `out`
    float offset;                 // double: the mean added back
    int nested_blocksize;         // double
    int is_double;
    int block_start;              // first CUDA block of this entry
};
static_assert(sizeof(Nf4GroupEntry) == 80, "mirrored by rtune_ops::nf4::group::GroupEntry");

struct Nf4GroupTable {
    Nf4GroupEntry e[NF4_GROUP_MAX];
    int count;
    int total_blocks;
};
static_assert(sizeof(Nf4GroupTable) == 8 * 80 + 8, "mirrored by rtune_ops::nf4::group::GroupTable");

template <typename T>
__device__ __forceinline__ void dequant_group(const Nf4GroupTable& t, T* __restrict__ out) {
    int i = 0;
    while (i + 1 < t.count && (int)blockIdx.x >= t.e[i + 1].block_start) ++i;
    const Nf4GroupEntry& e = t.e[i];
    const long long block = (long long)blockIdx.x - e.block_start;
    T* dst = out + e.out_offset;
    if (e.is_double) {
        dequant<T>(e.packed, DoubleScale{e.codes, e.nested_absmax, e.nested_map, e.offset,
                                         e.nested_blocksize},
                   e.quant_map, dst, e.n, block);
    } else {
        dequant<T>(e.packed, PlainScale{e.absmax}, e.quant_map, dst, e.n, block);
    }
}

#define NF4_GROUP_KERNEL(SUFFIX, T)                                                                \
    extern "C" __global__ void nf4_dequant_group_##SUFFIX(const Nf4GroupTable table,               \
                                                          T* __restrict__ out) {                   \
        dequant_group<T>(table, out);                                                              \
    }

NF4_GROUP_KERNEL(f32, float)
NF4_GROUP_KERNEL(f16, __half)
NF4_GROUP_KERNEL(bf16, __nv_bfloat16)
