/* C ABI of kernels/cudnn_sdpa.cpp: attention (scaled dot-product, causal, optional sliding window,
 * GQA/MQA, bf16/f16) forward and backward through cuDNN's fused SDPA graphs (cudnn-frontend's
 * graph API), cuDNN itself loaded at run time (rtune_cudnn_load). The Rust side of this ABI is
 * crates/ops/src/attention/cudnn.rs (struct layout, codes) and cudnn_ffi.rs (the calls).
 *
 * Layouts: every tensor is described in cuDNN's logical order (B, H, S, D) with element strides,
 * so rtune's q (B, H, T, Dh), k/v (B, Hkv, T, Dh) and o (B, T, H, Dh) are passed without copies;
 * lse is cuDNN's "Stats" (B, H, S, 1) f32, given rtune's (B, T, H) strides (the natural-log
 * log-sum-exp of the scaled scores, as kernels/flash_attn.cu writes it).
 *
 * Every call returns RTUNE_SDPA_OK, RTUNE_SDPA_UNSUPPORTED (cuDNN cannot express or run this
 * graph: the caller runs its own kernel) or RTUNE_SDPA_ERROR (a failure: message in `err`). No C++
 * exception crosses this boundary. */
#ifndef RTUNE_CUDNN_SDPA_H
#define RTUNE_CUDNN_SDPA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RTUNE_SDPA_OK 0
#define RTUNE_SDPA_UNSUPPORTED 1
#define RTUNE_SDPA_ERROR 2

#define RTUNE_SDPA_BF16 1
#define RTUNE_SDPA_F16 2

/* One attention call's shape (208 bytes; same fields and order as `SdpaDesc` in cudnn.rs). */
typedef struct {
    int64_t b, h, hkv, s, d;
    /* Element strides in (B, H, S, D) order. q (and dq), k (and dk), v (and dv), o (and d_o). */
    int64_t q[4], k[4], v[4], o[4];
    /* lse's strides in (B, H, S) order (the 4th, of a size-1 dim, is 1). */
    int64_t lse[3];
    /* RTUNE_SDPA_BF16 or RTUNE_SDPA_F16. */
    int32_t dtype;
    /* 0: causal; w > 0: query i sees keys i - w < j <= i (cuDNN's diagonal band, left bound w). */
    int32_t window;
    float scale;
    int32_t pad;
} rtune_sdpa_desc;

/* dlopen()s `path` (e.g. "libcudnn.so.9") for every later call; returns cuDNN's version
 * (e.g. 92801) or -1 with the reason in `err`. Once a library is loaded, later calls return its
 * version. */
int64_t rtune_cudnn_load(const char *path, char *err, size_t err_len);

/* Workspace bytes the forward (bwd = 0) or backward (bwd = 1) graph of `desc` needs on the current
 * device, building and caching the graph on first use; -1 when cuDNN cannot run it (reason in
 * `err`: the caller falls back), -2 on an error. */
int64_t rtune_cudnn_sdpa_workspace(const rtune_sdpa_desc *desc, int bwd, char *err, size_t err_len);

/* o = attention(q, k, v), lse = its log-sum-exp, on `stream` (a cudaStream_t), with `workspace`
 * of at least rtune_cudnn_sdpa_workspace(desc, 0) bytes. */
int rtune_cudnn_sdpa_fwd(const rtune_sdpa_desc *desc, void *stream, const void *q, const void *k,
                         const void *v, void *o, float *lse, void *workspace, size_t workspace_len,
                         char *err, size_t err_len);

/* dq, dk, dv from the forward's inputs, its o and lse, and d_o (laid out as o), on `stream`; the
 * deterministic algorithm (no atomics), as the own kernel. */
int rtune_cudnn_sdpa_bwd(const rtune_sdpa_desc *desc, void *stream, const void *q, const void *k,
                         const void *v, const void *o, const void *d_o, const float *lse, void *dq,
                         void *dk, void *dv, void *workspace, size_t workspace_len, char *err,
                         size_t err_len);

#ifdef __cplusplus
}
#endif

#endif
