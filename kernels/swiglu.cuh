// SwiGLU's activation for glu.cuh: device code only, included by fused.cu. Launchers:
// crates/ops/src/glu/cuda.rs; reference: crates/ops/src/swiglu/reference.rs.
#pragma once

#include "glu.cuh"

// silu(g) = g / (1 + e^-g) (candle's silu, here in f32). Backward: s = 1/(e^-g + 1);
// a = g·s; da = s·(g·(1 − s) + 1); du = T(dh·a) (a not rounded first).
struct Silu {
    static constexpr bool ROUND_GATE_IN_BWD = false;
    static __device__ __forceinline__ float fwd(float g) {
        return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    }
    static __device__ __forceinline__ void bwd(float g, float& a, float& da) {
        const float s = __frcp_rn(__fadd_rn(expf(-g), 1.0f));
        a = __fmul_rn(g, s);
        da = __fmul_rn(s, __fadd_rn(__fmul_rn(g, __fsub_rn(1.0f, s)), 1.0f));
    }
};
