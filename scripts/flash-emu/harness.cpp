// Host emulation of kernels/flash_attn.cu (see scripts/flash-emu.sh): runs the f32 and bf16 kernels
// with a block's threads as OS threads and checks them against a dense double-precision attention.
#include "emu.h"
#include "fa.cpp"  // kernels/flash_attn.cu, patched by scripts/flash-emu.sh
#include <thread>
#include <vector>
#include <random>
#include <memory>
#include "runtime.h"
__attribute__((aligned(128))) unsigned char flash_smem[262144];
template <typename F> void launch(dim3e grid, unsigned threads, unsigned smem, F f) {
    gridDim = grid; blockDim = {threads, 1, 1}; emu_smem_bytes = smem;
    for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y) for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = {x, y, z};
        memset(flash_smem, 0xcd, sizeof flash_smem);  // garbage, as on a GPU
        emu_new_block();
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; ++t) ts.emplace_back([=] { threadIdx = {t, 0, 0}; f(); });
        for (auto& t : ts) t.join();
    }
}
static size_t rr(size_t n) { return (n + 127) / 128 * 128; }
template <typename E> struct KX;
template <> struct KX<float> {
    static constexpr auto fwd = flash_fwd_f32_d64; static constexpr auto pre = flash_bwd_pre_f32;
    static constexpr auto dkdv = flash_bwd_dkdv_f32_d64; static constexpr auto dq = flash_bwd_dq_f32_d64;
    static float of(float x) { return x; } static float f(float x) { return x; } static constexpr double tol = 2e-5; };
template <> struct KX<__nv_bfloat16> {
    static constexpr auto fwd = flash_fwd_bf16_d64; static constexpr auto pre = flash_bwd_pre_bf16;
    static constexpr auto dkdv = flash_bwd_dkdv_bf16_d64; static constexpr auto dq = flash_bwd_dq_bf16_d64;
    static __nv_bfloat16 of(float x) { return __float2bfloat16_rn(x); } static float f(__nv_bfloat16 x) { return __bfloat162float(x); } static float f(float x) { return x; } static constexpr double tol = 2e-2; };
template <typename E>
int run(int B, int H, int HKV, int T, int DHv, int window, bool packed, int off) {
    const int DH = 64; (void)DHv;
    std::mt19937 g(B * 1000 + T + window + off); std::normal_distribution<float> nd;
    size_t nq = (size_t)B * H * T * DH, nk = (size_t)B * HKV * T * DH, nl = (size_t)B * T * H;
    std::vector<E> bq(nq + off), bk(nk + off), bv(nk + off), bdo(nq + off), bo(nq + off), bdq(nq + off), bdk(nk + off), bdv(nk + off);
    std::vector<float> blse(nl + off), bdd(nl);
    E *q = bq.data() + off, *k = bk.data() + off, *v = bv.data() + off, *dO = bdo.data() + off, *o = bo.data() + off;
    float* lse = blse.data() + off;
    E *dq = bdq.data() + off, *dk = bdk.data() + off, *dv = bdv.data() + off;
    for (size_t i = 0; i < nq; ++i) { q[i] = KX<E>::of(1.5f * nd(g)); dO[i] = KX<E>::of(nd(g)); }
    for (size_t i = 0; i < nk; ++i) { k[i] = KX<E>::of(1.5f * nd(g)); v[i] = KX<E>::of(nd(g)); }
    int SB = packed ? B : 1; std::vector<unsigned> st(SB * T);
    for (int b = 0; b < SB; ++b) { int first = 0; for (int i = 0; i < T; ++i) { if (packed && (i == 7 + 3 * b || i == 40 - b)) first = i; int s = first; if (window > 0) s = std::max(s, i - window + 1); st[b * T + i] = s; } }
    FlashParams p{(long long)H * T * DH, (long long)T * DH, DH, (long long)HKV * T * DH, (long long)T * DH, DH, (long long)T * H * DH, DH, (long long)H * DH, (long long)T * H, 1, H, B, H, HKV, T, SB, 1.0f / sqrtf((float)DH)};
    const int es = sizeof(E), lt = DH + 16 / es, ls = BC + 4, la = DH + 4, lp = BC + 16 / es;
    unsigned fwd = rr(BR * lt * es) + 2 * rr(BC * lt * es) + rr(BR * ls * 4) + rr(BR * lp * es) + rr(BR * la * 4) + 4 * rr(BR * 4);
    unsigned dkdv = 2 * rr(BC * lt * es) + 2 * rr(BC * la * 4) + 2 * rr(BR * lt * es) + 2 * rr(BR * ls * 4) + 2 * rr(BR * lp * es) + 3 * rr(BR * 4);
    unsigned dqs = 2 * rr(BR * lt * es) + 2 * rr(BC * lt * es) + 2 * rr(BR * ls * 4) + 2 * rr(BR * lp * es) + rr(BR * la * 4) + 3 * rr(BR * 4);
    launch({(unsigned)((T + BR - 1) / BR), (unsigned)H, (unsigned)B}, THREADS, fwd, [&] { KX<E>::fwd(q, k, v, st.data(), o, lse, p); });
    launch({4, 1, 1}, 256, 0, [&] { KX<E>::pre(o, dO, bdd.data(), p, DH); });
    launch({(unsigned)((T + BC - 1) / BC), (unsigned)HKV, (unsigned)B}, THREADS, dkdv, [&] { KX<E>::dkdv(q, k, v, dO, lse, bdd.data(), st.data(), dk, dv, p); });
    launch({(unsigned)((T + BR - 1) / BR), (unsigned)H, (unsigned)B}, THREADS, dqs, [&] { KX<E>::dq(q, k, v, dO, lse, bdd.data(), st.data(), dq, p); });
    // dense reference in double
    std::vector<double> ro(nq), rl(nl), rdq(nq), rdk(nk), rdv(nk);
    double sc = 1.0 / sqrt((double)DH);
    int G = H / HKV;
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int i = 0; i < T; ++i) {
        int hk = h / G; int s0 = st[(SB == 1 ? 0 : b) * T + i];
        auto Q = [&](int d) { return (double)KX<E>::f(q[((size_t)(b * H + h) * T + i) * DH + d]); };
        auto K = [&](int j, int d) { return (double)KX<E>::f(k[((size_t)(b * HKV + hk) * T + j) * DH + d]); };
        auto V = [&](int j, int d) { return (double)KX<E>::f(v[((size_t)(b * HKV + hk) * T + j) * DH + d]); };
        size_t oat = ((size_t)(b * T + i) * H + h) * DH;
        std::vector<double> s(T, -INFINITY), pr(T, 0), dp(T, 0); double m = -INFINITY;
        for (int j = s0; j <= i; ++j) { double x = 0; for (int d = 0; d < DH; ++d) x += Q(d) * K(j, d); s[j] = x * sc; m = std::max(m, s[j]); }
        double l = 0; for (int j = s0; j <= i; ++j) { pr[j] = exp(s[j] - m); l += pr[j]; }
        for (int j = s0; j <= i; ++j) pr[j] /= l;
        rl[(size_t)(b * T + i) * H + h] = m + log(l);
        for (int d = 0; d < DH; ++d) { double x = 0; for (int j = s0; j <= i; ++j) x += pr[j] * V(j, d); ro[oat + d] = x; }
        double D = 0; for (int j = s0; j <= i; ++j) { double x = 0; for (int d = 0; d < DH; ++d) x += KX<E>::f(dO[oat + d]) * V(j, d); dp[j] = x; D += pr[j] * x; }
        for (int j = s0; j <= i; ++j) {
            double ds = pr[j] * (dp[j] - D) * sc;
            for (int d = 0; d < DH; ++d) {
                rdq[((size_t)(b * H + h) * T + i) * DH + d] += ds * K(j, d);
                rdk[((size_t)(b * HKV + hk) * T + j) * DH + d] += ds * Q(d);
                rdv[((size_t)(b * HKV + hk) * T + j) * DH + d] += pr[j] * KX<E>::f(dO[oat + d]);
            }
        }
    }
    auto cmp = [](const char* w, auto* got, const std::vector<double>& want) {
        double mx = 0, e = 0; for (size_t i = 0; i < want.size(); ++i) { mx = std::max(mx, fabs(want[i])); e = std::max(e, fabs((double)KX<E>::f(got[i]) - want[i])); }
        printf("  %s rel err %.2e\n", w, e / mx); return e / mx < (std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(got)>>, float> && sizeof(E) == 2 ? 2e-5 : KX<E>::tol);
    };
    printf("%s B %d H %d/%d T %d window %d packed %d offset %d\n", sizeof(E) == 4 ? "f32" : "bf16", B, H, HKV, T, window, packed, off);
    bool ok = cmp("o", o, ro) & cmp("lse", lse, rl) & cmp("dq", dq, rdq) & cmp("dk", dk, rdk) & cmp("dv", dv, rdv);
    printf("  %s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
int main() {
    int f = 0;
    f += run<__nv_bfloat16>(2, 4, 2, 77, 64, 0, false, 0);
    f += run<__nv_bfloat16>(2, 4, 2, 99, 64, 20, true, 1);
    f += run<float>(2, 4, 2, 77, 64, 0, false, 0);
    f += run<float>(1, 4, 1, 130, 64, 0, false, 1);
    f += run<float>(2, 4, 2, 12, 64, 5, false, 0);
    f += run<float>(2, 4, 2, 99, 64, 20, true, 0);
    f += run<float>(2, 2, 2, 70, 64, 0, true, 3);
    return f;
}
