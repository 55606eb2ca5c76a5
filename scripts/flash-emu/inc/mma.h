// Host stand-in for mma.h (scripts/flash-emu.sh): nvcuda::wmma with whole-tile fragments per lane.
#pragma once
#include "cuda_bf16.h"
namespace nvcuda { namespace wmma {
struct row_major {}; struct col_major {}; struct matrix_a {}; struct matrix_b {}; struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };
// Emulation: every lane holds the whole 16x16 tile (warp-collective ops run redundantly per lane,
// fenced by __syncwarp so no lane stores before every lane has loaded).
template <typename U, int M, int N, int K, typename T, typename L = void> struct fragment { float v[16][16]; };
inline float cvt(float x) { return x; }
inline float cvt(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename U, typename T, typename L> void load_matrix_sync(fragment<U, 16, 16, 16, T, L>& f, const T* p, unsigned ld) {
    __syncwarp();
    constexpr bool row = std::is_same_v<L, row_major>;
    for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) f.v[i][j] = cvt(row ? p[i * ld + j] : p[i + j * ld]);
    __syncwarp();
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ld, layout_t) {
    __syncwarp();
    for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) f.v[i][j] = p[i * ld + j];
    __syncwarp();
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ld, layout_t) {
    __syncwarp();
    for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) p[i * ld + j] = f.v[i][j];
    __syncwarp();
}
inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float x) {
    for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) f.v[i][j] = x;
}
template <typename A, typename B>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const A& a, const B& b, const fragment<accumulator, 16, 16, 16, float>& c) {
    float t[16][16];
    for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) { float s = c.v[i][j]; for (int k = 0; k < 16; ++k) s += a.v[i][k] * b.v[k][j]; t[i][j] = s; }
    for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) d.v[i][j] = t[i][j];
}
} }
