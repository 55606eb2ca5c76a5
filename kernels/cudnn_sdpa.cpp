// Attention through cuDNN's fused SDPA (scaled dot-product attention) graphs, forward and
// backward: the C ABI of cudnn_sdpa.h over cudnn-frontend's graph API (header-only, v1.x), cuDNN
// loaded at run time (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING: the front end resolves every cuDNN
// and CUDA runtime symbol through dlsym, so this file links against neither).
//
// Semantics are rtune's tiled attention's (crates/ops/src/attention/tiled.rs, flash_ref.rs):
//   S = Q·Kᵀ·scale (f32), causal (query i sees keys j ≤ i), with a window w keys j > i − w,
//   P = softmax(S) per query, O = P·V (the io type), lse = log Σ_j e^{S_ij} (natural log, f32);
//   GQA: query head h reads kv head h / (H / Hkv). cuDNN computes in f32 with the io type's
//   operands (bf16/f16 only: its fused SDPA has no f32 io).
//
// One graph per (device, direction, shape, strides, dtype, window, scale), built on first use
// (cuDNN's heuristics, then its plan: ~0.1–1 s) and cached (the training step calls one shape
// per layer, the same every step). The cache holds at most kMaxGraphs; past that the least
// recently used graph is dropped (unpadded batches of every length would otherwise grow it
// without bound: one forward and one backward graph per length). One cuDNN handle per device,
// its stream set before each execution; one mutex around both caches and the executions (a
// handle is not thread-safe).

#define CUDNN_FRONTEND_SKIP_JSON_LIB
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cudnn_frontend.h>

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cudnn_sdpa.h"

namespace fe = cudnn_frontend;

// The layout crates/backend/src/cudnn.rs's `SdpaDesc` has (its test asserts the same numbers).
static_assert(sizeof(rtune_sdpa_desc) == 208, "rtune_sdpa_desc is 208 bytes");
static_assert(offsetof(rtune_sdpa_desc, q) == 40 && offsetof(rtune_sdpa_desc, o) == 136, "strides");
static_assert(offsetof(rtune_sdpa_desc, lse) == 168 && offsetof(rtune_sdpa_desc, dtype) == 192, "lse, dtype");
static_assert(offsetof(rtune_sdpa_desc, window) == 196 && offsetof(rtune_sdpa_desc, scale) == 200, "window, scale");

// The front end reads cuDNN's symbols from this handle (declared extern in cudnn_frontend_shim.h).
namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr;
}

namespace {

enum Uid : int64_t { Q = 1, K, V, O, LSE, DO, DQ, DK, DV };

// The outcome of one step: OK, or a code and a message for the caller.
struct Outcome {
    int code;
    std::string message;
};

void write_err(const std::string &m, char *err, size_t len) {
    if (err && len) {
        std::snprintf(err, len, "%s", m.c_str());
    }
}

// A front-end error as an outcome: "not supported" where cuDNN cannot run the graph (the caller
// then runs its own kernel), an error otherwise.
Outcome from_fe(fe::error_object e, const char *stage) {
    if (e.is_good()) {
        return {RTUNE_SDPA_OK, ""};
    }
    bool unsupported = e.get_code() == fe::error_code_t::GRAPH_NOT_SUPPORTED ||
                       e.get_code() == fe::error_code_t::GRAPH_EXECUTION_PLAN_CREATION_FAILED ||
                       e.get_code() == fe::error_code_t::HEURISTIC_QUERY_FAILED;
    return {unsupported ? RTUNE_SDPA_UNSUPPORTED : RTUNE_SDPA_ERROR,
            std::string(stage) + ": " + e.get_message()};
}

std::vector<int64_t> dims4(int64_t b, int64_t h, int64_t s, int64_t d) { return {b, h, s, d}; }
std::vector<int64_t> strides4(const int64_t *s) { return {s[0], s[1], s[2], s[3]}; }

using Key = std::tuple<int, int, std::vector<int64_t>>;

// Everything a graph depends on, as integers (the scale by its bits).
Key key_of(int device, int bwd, const rtune_sdpa_desc &d) {
    std::vector<int64_t> k = {d.b, d.h, d.hkv, d.s, d.d, d.dtype, d.window};
    for (const int64_t *s : {d.q, d.k, d.v, d.o}) {
        k.insert(k.end(), s, s + 4);
    }
    k.insert(k.end(), d.lse, d.lse + 3);
    uint32_t bits;
    std::memcpy(&bits, &d.scale, sizeof bits);
    k.push_back(bits);
    return {device, bwd, k};
}

struct Cached {
    std::shared_ptr<fe::graph::Graph> graph;  // null: cuDNN cannot run this one
    std::string why;                          // the reason, when null
    int64_t workspace = 0;
    uint64_t used = 0;  // `tick` at the last lookup: the eviction order
};

// Enough for every (length, direction) of a run with up to 128 distinct batch lengths.
constexpr size_t kMaxGraphs = 256;

std::mutex mu;  // guards everything below and every execution
std::map<Key, Cached> graphs;
uint64_t tick = 0;
std::unordered_map<int, cudnnHandle_t> handles;
int64_t loaded_version = 0;

Outcome handle_for(int device, cudnnHandle_t *out) {
    auto it = handles.find(device);
    if (it != handles.end()) {
        *out = it->second;
        return {RTUNE_SDPA_OK, ""};
    }
    cudnnHandle_t h = nullptr;
    cudnnStatus_t st = fe::detail::create_handle(&h);
    if (st != CUDNN_STATUS_SUCCESS) {
        return {RTUNE_SDPA_ERROR, "cudnnCreate: status " + std::to_string(static_cast<int>(st))};
    }
    handles[device] = h;
    *out = h;
    return {RTUNE_SDPA_OK, ""};
}

// The causal (and windowed) mask of rtune's attention on a graph's SDPA options.
template <class A>
void mask(A &opt, const rtune_sdpa_desc &d) {
    opt.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    if (d.window > 0) {
        // cuDNN masks key j of query i unless j + left_bound > i: left_bound = w keeps
        // j > i − w, rtune's window of w keys (the query's own included).
        opt.set_diagonal_band_left_bound(d.window);
    }
}

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph &g, const char *name, Uid uid,
                                                    std::vector<int64_t> dim, const int64_t *stride) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim(std::move(dim))
                        .set_stride(strides4(stride)));
}

// Builds the forward (bwd = 0) or backward graph of `d`; null with the reason when cuDNN cannot
// run it.
Outcome build(const rtune_sdpa_desc &d, int bwd, cudnnHandle_t handle, Cached *out) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(d.dtype == RTUNE_SDPA_F16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto q = input(*g, "q", Q, dims4(d.b, d.h, d.s, d.d), d.q);
    auto k = input(*g, "k", K, dims4(d.b, d.hkv, d.s, d.d), d.k);
    auto v = input(*g, "v", V, dims4(d.b, d.hkv, d.s, d.d), d.v);
    const std::vector<int64_t> lse_dim = {d.b, d.h, d.s, 1};
    const std::vector<int64_t> lse_stride = {d.lse[0], d.lse[1], d.lse[2], 1};
    if (!bwd) {
        auto opt = fe::graph::SDPA_attributes().set_name("rtune_sdpa_fwd").set_generate_stats(true).set_attn_scale(d.scale);
        mask(opt, d);
        auto [o, stats] = g->sdpa(q, k, v, opt);
        o->set_output(true).set_uid(O).set_dim(dims4(d.b, d.h, d.s, d.d)).set_stride(strides4(d.o));
        stats->set_output(true)
            .set_uid(LSE)
            .set_data_type(fe::DataType_t::FLOAT)
            .set_dim(lse_dim)
            .set_stride(lse_stride);
    } else {
        auto o = input(*g, "o", O, dims4(d.b, d.h, d.s, d.d), d.o);
        auto d_o = input(*g, "d_o", DO, dims4(d.b, d.h, d.s, d.d), d.o);
        auto stats = g->tensor(fe::graph::Tensor_attributes()
                                   .set_name("lse")
                                   .set_uid(LSE)
                                   .set_dim(lse_dim)
                                   .set_stride(lse_stride)
                                   .set_data_type(fe::DataType_t::FLOAT));
        auto opt = fe::graph::SDPA_backward_attributes()
                       .set_name("rtune_sdpa_bwd")
                       .set_attn_scale(d.scale)
                       .set_deterministic_algorithm(true);
        mask(opt, d);
        auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, opt);
        dq->set_output(true).set_uid(DQ).set_dim(dims4(d.b, d.h, d.s, d.d)).set_stride(strides4(d.q));
        dk->set_output(true).set_uid(DK).set_dim(dims4(d.b, d.hkv, d.s, d.d)).set_stride(strides4(d.k));
        dv->set_output(true).set_uid(DV).set_dim(dims4(d.b, d.hkv, d.s, d.d)).set_stride(strides4(d.v));
    }
    Outcome r = from_fe(g->validate(), "validate");
    if (r.code == RTUNE_SDPA_OK) r = from_fe(g->build_operation_graph(handle), "build_operation_graph");
    if (r.code == RTUNE_SDPA_OK) r = from_fe(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
    if (r.code == RTUNE_SDPA_OK) r = from_fe(g->check_support(handle), "check_support");
    if (r.code == RTUNE_SDPA_OK) r = from_fe(g->build_plans(handle), "build_plans");
    if (r.code == RTUNE_SDPA_OK) {
        int64_t ws = 0;
        r = from_fe(g->get_workspace_size(ws), "get_workspace_size");
        out->graph = g;
        out->workspace = ws;
    } else if (r.code == RTUNE_SDPA_UNSUPPORTED) {
        out->why = r.message;
    }
    return r;
}

// The cached graph of `d` on the current device (built on first use); mu held.
Outcome graph_for(const rtune_sdpa_desc &d, int bwd, const Cached **out, cudnnHandle_t *handle) {
    if (!fe::cudnn_dlhandle) {
        return {RTUNE_SDPA_ERROR, "cuDNN is not loaded (rtune_cudnn_load first)"};
    }
    if (d.dtype != RTUNE_SDPA_BF16 && d.dtype != RTUNE_SDPA_F16) {
        return {RTUNE_SDPA_UNSUPPORTED, "cuDNN's fused SDPA takes bf16 or f16, not dtype " + std::to_string(d.dtype)};
    }
    int device = 0;
    if (fe::detail::cuda_get_device(&device) != cudaSuccess) {
        return {RTUNE_SDPA_ERROR, "cudaGetDevice failed"};
    }
    Outcome r = handle_for(device, handle);
    if (r.code != RTUNE_SDPA_OK) return r;
    Key key = key_of(device, bwd, d);
    auto it = graphs.find(key);
    if (it == graphs.end()) {
        Cached c;
        r = build(d, bwd, *handle, &c);
        if (r.code == RTUNE_SDPA_ERROR) return r;  // not cached: the next call retries
        if (graphs.size() >= kMaxGraphs) {
            // Drop the least recently used (no caller holds a graph past `mu`).
            auto lru = graphs.begin();
            for (auto j = graphs.begin(); j != graphs.end(); ++j) {
                if (j->second.used < lru->second.used) lru = j;
            }
            graphs.erase(lru);
        }
        it = graphs.emplace(std::move(key), std::move(c)).first;
    }
    it->second.used = ++tick;
    if (!it->second.graph) return {RTUNE_SDPA_UNSUPPORTED, it->second.why};
    *out = &it->second;
    return {RTUNE_SDPA_OK, ""};
}

// Runs `d`'s graph with `pack` on `stream`.
Outcome run(const rtune_sdpa_desc &d, int bwd, void *stream, std::unordered_map<int64_t, void *> &pack,
            void *workspace, size_t workspace_len) {
    std::lock_guard<std::mutex> lock(mu);
    const Cached *c = nullptr;
    cudnnHandle_t handle = nullptr;
    Outcome r = graph_for(d, bwd, &c, &handle);
    if (r.code != RTUNE_SDPA_OK) return r;
    if (static_cast<int64_t>(workspace_len) < c->workspace || (c->workspace > 0 && !workspace)) {
        return {RTUNE_SDPA_ERROR, "workspace of " + std::to_string(workspace_len) + " bytes, the graph needs " +
                                      std::to_string(c->workspace)};
    }
    cudnnStatus_t st = fe::detail::set_stream(handle, static_cast<cudaStream_t>(stream));
    if (st != CUDNN_STATUS_SUCCESS) {
        return {RTUNE_SDPA_ERROR, "cudnnSetStream: status " + std::to_string(static_cast<int>(st))};
    }
    r = from_fe(c->graph->execute(handle, pack, workspace), "execute");
    // A graph that validated and built is supported: a failure to run it is an error.
    if (r.code == RTUNE_SDPA_UNSUPPORTED) r.code = RTUNE_SDPA_ERROR;
    return r;
}

int finish(const Outcome &r, char *err, size_t len) {
    if (r.code != RTUNE_SDPA_OK) write_err(r.message, err, len);
    return r.code;
}

}  // namespace

extern "C" int64_t rtune_cudnn_load(const char *path, char *err, size_t err_len) {
    try {
        std::lock_guard<std::mutex> lock(mu);
        if (fe::cudnn_dlhandle) return loaded_version;
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *e = dlerror();
            write_err(std::string("dlopen ") + path + ": " + (e ? e : "unknown error"), err, err_len);
            return -1;
        }
        using GetVersion = size_t (*)();
        auto get_version = reinterpret_cast<GetVersion>(dlsym(h, "cudnnGetVersion"));
        if (!get_version) {
            write_err(std::string(path) + " has no cudnnGetVersion: not cuDNN", err, err_len);
            dlclose(h);
            return -1;
        }
        size_t v = get_version();
        if (v < 90000) {
            write_err(std::string(path) + " is cuDNN " + std::to_string(v) + ", want 9.x", err, err_len);
            dlclose(h);
            return -1;
        }
        fe::cudnn_dlhandle = h;
        loaded_version = static_cast<int64_t>(v);
        return loaded_version;
    } catch (const std::exception &e) {
        write_err(std::string("rtune_cudnn_load: ") + e.what(), err, err_len);
        return -1;
    }
}

extern "C" int64_t rtune_cudnn_sdpa_workspace(const rtune_sdpa_desc *desc, int bwd, char *err, size_t err_len) {
    try {
        std::lock_guard<std::mutex> lock(mu);
        const Cached *c = nullptr;
        cudnnHandle_t handle = nullptr;
        Outcome r = graph_for(*desc, bwd, &c, &handle);
        if (r.code == RTUNE_SDPA_OK) return c->workspace;
        write_err(r.message, err, err_len);
        return r.code == RTUNE_SDPA_UNSUPPORTED ? -1 : -2;
    } catch (const std::exception &e) {
        write_err(std::string("rtune_cudnn_sdpa_workspace: ") + e.what(), err, err_len);
        return -2;
    }
}

extern "C" int rtune_cudnn_sdpa_fwd(const rtune_sdpa_desc *desc, void *stream, const void *q, const void *k,
                                    const void *v, void *o, float *lse, void *workspace, size_t workspace_len,
                                    char *err, size_t err_len) {
    try {
        std::unordered_map<int64_t, void *> pack = {{Q, const_cast<void *>(q)},
                                                    {K, const_cast<void *>(k)},
                                                    {V, const_cast<void *>(v)},
                                                    {O, o},
                                                    {LSE, lse}};
        return finish(run(*desc, 0, stream, pack, workspace, workspace_len), err, err_len);
    } catch (const std::exception &e) {
        write_err(std::string("rtune_cudnn_sdpa_fwd: ") + e.what(), err, err_len);
        return RTUNE_SDPA_ERROR;
    }
}

extern "C" int rtune_cudnn_sdpa_bwd(const rtune_sdpa_desc *desc, void *stream, const void *q, const void *k,
                                    const void *v, const void *o, const void *d_o, const float *lse, void *dq,
                                    void *dk, void *dv, void *workspace, size_t workspace_len, char *err,
                                    size_t err_len) {
    try {
        std::unordered_map<int64_t, void *> pack = {{Q, const_cast<void *>(q)},
                                                    {K, const_cast<void *>(k)},
                                                    {V, const_cast<void *>(v)},
                                                    {O, const_cast<void *>(o)},
                                                    {DO, const_cast<void *>(d_o)},
                                                    {LSE, const_cast<float *>(lse)},
                                                    {DQ, dq},
                                                    {DK, dk},
                                                    {DV, dv}};
        return finish(run(*desc, 1, stream, pack, workspace, workspace_len), err, err_len);
    } catch (const std::exception &e) {
        write_err(std::string("rtune_cudnn_sdpa_bwd: ") + e.what(), err, err_len);
        return RTUNE_SDPA_ERROR;
    }
}
