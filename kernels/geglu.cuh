// GeGLU's activation (Gemma's gelu_pytorch_tanh) for glu.cuh: device code only, included by
// fused.cu. Launchers: crates/ops/src/glu/cuda.rs; reference: crates/ops/src/geglu/ (mod.rs's f32
// steps, which these are, in the same order).
#pragma once

#include "glu.cuh"

// t = tanh((x + C·x³)·K), x³ = (x·x)·x, K = √(2/π), C = 0.044715; act = (x·0.5)·(t + 1);
// act' = (t + 1)·0.5 + ((x·K/2)·(1 − t²))·(x²·3C + 1). du = T(dh·T(act)) (act rounded first).
struct GeluTanh {
    static constexpr bool ROUND_GATE_IN_BWD = true;
    static __device__ __forceinline__ float inner(float x) {
        const float x3 = __fmul_rn(__fmul_rn(x, x), x);
        return tanhf(__fmul_rn(__fadd_rn(x, __fmul_rn(x3, 0.044715f)), 0.7978845608028654f));
    }
    static __device__ __forceinline__ float act(float x, float t) {
        return __fmul_rn(__fmul_rn(x, 0.5f), __fadd_rn(t, 1.0f));
    }
    static __device__ __forceinline__ float fwd(float x) { return act(x, inner(x)); }
    static __device__ __forceinline__ void bwd(float x, float& a, float& da) {
        const float t = inner(x);
        a = act(x, t);
        const float one_minus_t2 = __fsub_rn(1.0f, __fmul_rn(t, t));
        const float poly = __fadd_rn(__fmul_rn(__fmul_rn(x, x), 0.134145f), 1.0f);  // 3·0.044715
        da = __fadd_rn(__fmul_rn(__fadd_rn(t, 1.0f), 0.5f),
                       __fmul_rn(__fmul_rn(__fmul_rn(x, 0.3989422804014327f), one_minus_t2), poly));
    }
};
