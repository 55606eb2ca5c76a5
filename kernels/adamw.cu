// Multi-tensor gradient norm, clipping and AdamW over every LoRA tensor of a step, in three launches
// (the torch.optim.AdamW rule as crates/train/src/optim.rs implements it on the CPU, with
// torch.nn.utils.clip_grad_norm_'s coefficient). CPU reference, loop for loop:
// crates/ops/src/adamw/mod.rs (`multi_tensor_sq_norm`, `clip_coef`, `multi_tensor_adamw`).
//
// Tables (built on the host, copied to the device):
//   tensors[4·k .. 4·k+4] = (grad ptr, out ptr, offset, numel) of tensor k: its f32 gradient (0: a
//       zero gradient), where to write its updated weights besides the master copy (0: nowhere),
//       its first element in the flat master/m/v buffers, its element count;
//   chunks[2·c .. 2·c+2]  = (tensor, start) of chunk c: elements start .. min(start+CHUNK, numel)
//       of that tensor, chunks of every tensor in order (an empty tensor has none).
// 1. mt_sq_norm_partial: one block of THREADS threads per chunk (grid-stride over chunks); thread t
//    sums (g·unscale)² over elements start+t, start+t+THREADS, ... in f64, then a shared-memory tree
//    (s = THREADS/2, ..., 1: lane[t] += lane[t+s]) gives partials[c].
// 2. mt_norm_finalize: one block; thread t sums partials t, t+THREADS, ... in order, the same tree,
//    then norm = sqrt(total) and coef = max_norm > 0 ? min(1, max_norm/(norm + 1e-6)) : 1 into
//    norm_coef[0..2]. The host reads norm_coef[0] once a step (the metrics' grad_norm and the skip
//    decision); nothing else goes back to the host.
// 3. mt_adamw: one block per chunk again; returns at once when norm is not finite (the step is
//    skipped, as torch's GradScaler: the host does not advance the step count). Per element, f32:
//      g = (g·unscale)·f32(coef);  p = p·decay;  m = m + w1·(g − m);  v = v·b2 + (w2·g)·g;
//      p = p − (step_size·m) / (sqrt(v)/bc2_sqrt + eps)
//    with the scalars computed on the host in f64 and rounded to f32 as the CPU optimizer does.
// Every operation is a separate IEEE-rounded intrinsic (__fmul_rn, __dadd_rn, ...): nvcc would
// otherwise contract multiply-adds into FMAs and differ from the CPU in the last bit. The order of
// every sum is fixed (independent of the grid size), so the CPU reference reproduces the kernels
// bit for bit.

#include <stdint.h>

#define MT_CHUNK 2048
#define MT_THREADS 256

// The tree over one block's lanes: lane[0] ends with the sum. Every thread of the block calls it.
__device__ __forceinline__ double mt_block_tree(double* lane) {
    __syncthreads();
#pragma unroll
    for (int s = MT_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) lane[threadIdx.x] = __dadd_rn(lane[threadIdx.x], lane[threadIdx.x + s]);
        __syncthreads();
    }
    return lane[0];
}

__device__ __forceinline__ float mt_grad(const unsigned long long* e, unsigned long long i) {
    const float* g = reinterpret_cast<const float*>(e[0]);
    return g == nullptr ? 0.0f : g[i];
}

extern "C" __global__ void __launch_bounds__(MT_THREADS)
    mt_sq_norm_partial(const unsigned long long* __restrict__ tensors,
                       const unsigned long long* __restrict__ chunks, unsigned long long n_chunks,
                       float unscale, double* __restrict__ partials) {
    __shared__ double lane[MT_THREADS];
    for (unsigned long long c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const unsigned long long* e = tensors + 4 * chunks[2 * c];
        const unsigned long long start = chunks[2 * c + 1];
        const unsigned long long end = min(start + MT_CHUNK, e[3]);
        double acc = 0.0;
        for (unsigned long long i = start + threadIdx.x; i < end; i += MT_THREADS) {
            const double x = (double)__fmul_rn(mt_grad(e, i), unscale);
            acc = __dadd_rn(acc, __dmul_rn(x, x));
        }
        lane[threadIdx.x] = acc;
        const double sum = mt_block_tree(lane);
        if (threadIdx.x == 0) partials[c] = sum;
        __syncthreads();  // lane is rewritten by the next chunk
    }
}

extern "C" __global__ void __launch_bounds__(MT_THREADS)
    mt_norm_finalize(const double* __restrict__ partials, unsigned long long n_chunks, double max_norm,
                     double* __restrict__ norm_coef) {
    __shared__ double lane[MT_THREADS];
    double acc = 0.0;
    for (unsigned long long c = threadIdx.x; c < n_chunks; c += MT_THREADS) acc = __dadd_rn(acc, partials[c]);
    lane[threadIdx.x] = acc;
    const double total = mt_block_tree(lane);
    if (threadIdx.x == 0) {
        const double norm = __dsqrt_rn(total);
        double coef = 1.0;
        if (max_norm > 0.0) coef = fmin(__ddiv_rn(max_norm, __dadd_rn(norm, 1e-6)), 1.0);
        norm_coef[0] = norm;
        norm_coef[1] = coef;
    }
}

extern "C" __global__ void __launch_bounds__(MT_THREADS)
    mt_adamw(const unsigned long long* __restrict__ tensors, const unsigned long long* __restrict__ chunks,
             unsigned long long n_chunks, const double* __restrict__ norm_coef, float* __restrict__ master,
             float* __restrict__ m, float* __restrict__ v, float unscale, float w1, float b2, float w2,
             float eps, float bc2_sqrt, float step_size, float decay) {
    const double norm = norm_coef[0];
    if (!isfinite(norm)) return;
    const float coef = (float)norm_coef[1];
    for (unsigned long long c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const unsigned long long* e = tensors + 4 * chunks[2 * c];
        const unsigned long long start = chunks[2 * c + 1];
        const unsigned long long end = min(start + MT_CHUNK, e[3]);
        float* out = reinterpret_cast<float*>(e[1]);
        const unsigned long long off = e[2];
        for (unsigned long long i = start + threadIdx.x; i < end; i += MT_THREADS) {
            const float g = __fmul_rn(__fmul_rn(mt_grad(e, i), unscale), coef);
            float p = __fmul_rn(master[off + i], decay);
            const float mi = __fadd_rn(m[off + i], __fmul_rn(w1, __fsub_rn(g, m[off + i])));
            const float vi = __fadd_rn(__fmul_rn(v[off + i], b2), __fmul_rn(__fmul_rn(w2, g), g));
            const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
            p = __fsub_rn(p, __fdiv_rn(__fmul_rn(step_size, mi), denom));
            m[off + i] = mi;
            v[off + i] = vi;
            master[off + i] = p;
            if (out != nullptr) out[i] = p;
        }
    }
}
