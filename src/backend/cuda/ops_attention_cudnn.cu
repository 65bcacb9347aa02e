// Causal grouped-query attention through cuDNN's fused flash-attention
// engines, over the documents of a micro-batch (every query).
//
// cuDNN has no attention call in its C API: its engines recognise a pattern
// in an operation graph (the backend API of cudnn_graph.h). The forward
// graph is S = Q K^T (fp32), S * scale, the causal mask (row index >= column
// index, else -inf), the softmax written out as max, subtract, exp, sum and
// divide, with Stats = max + log(sum) (the natural log-sum-exp of the scaled
// scores), and O = P V. The backward graph recomputes P = exp(S * scale -
// Stats) under the same mask and forms dV = P^T dO, dP = dO V^T, dS = P (dP -
// rowsum(dO * O)) * scale, dK = dS^T Q, dQ = dS K (into an fp32 buffer,
// rounded by an identity op). Under grouped-query attention the per-query-head
// dK and dV are added over each group by a reduction. This is the graph the
// cuDNN frontend lowers its SDPA node to for cuDNN 9 (read from the backend's
// API log); the engines run it as one flash-attention kernel each way.
//
// Layouts: q, out, dout, dq are (T, Hq, D) and k, v, dk, dv (T, Hkv, D),
// token-major, which the graph takes as [B, H, L, D] with strides
// [L*H*D, D, H*D, 1].
// - Documents all L long: B = T / L sequences. cuDNN keeps Stats as
//   [B, Hq, L]; lse here is (T, Hq) as everywhere in loom, so two small
//   kernels transpose it on the way out and in.
// - Documents of other lengths ("ragged"): B = ndocs rounded up to a bucket
//   (32, then powers of 2 to 512) and L = T, every tensor given a ragged
//   offset per document (cuDNN's packed layout), the lengths as
//   SEQ_LEN tensors (0 for the padding entries) that bound every matmul
//   (M/N/K overrides) and a padding mask before the causal one. Stats is
//   ragged too, token-major: loom's lse layout. One plan per bucket, so
//   batches with other document counts reuse it.
// The results match loom_cuda_attention_fwd/bwd up to rounding: both paths
// produce the same lse, so either backward can follow either forward.
#include <cudnn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "ops_common.cuh"

using namespace loom_cuda;

namespace {

// Tensor unique ids of the graphs.
enum : int64_t {
    U_Q = 1, U_KT, U_V, U_VT, U_O, U_DO, U_STATS, U_SCALE, U_NEG_INF, U_ONE, U_SOFTMAX_SUM, U_DQ_ACC,
    U_DQ, U_DK, U_DV,
    U_SEQ_Q, U_SEQ_KV, U_OFF_Q, U_OFF_KV, U_OFF_ST, U_DK_FULL, U_DV_FULL, // ragged only
    U_VIRTUAL = 100, // intermediates from here on
};

enum { FWD = 0, BWD = 1 };

struct plan_key {
    int dir;
    loom_dtype dt;
    int64_t B, L, Hq, Hkv, D;
    bool ragged; // B a bucket of documents, L = T (see the top)
};

constexpr int MAX_DESC = 160;  // descriptors of one graph (the ragged backward needs ~110)
constexpr int CACHE = 8;       // shapes kept per handle

struct plan_entry {
    bool used, refused;
    plan_key key;
    cudnnBackendDescriptor_t desc[MAX_DESC]; // everything the plan was built from
    int ndesc;
    cudnnBackendDescriptor_t graph, plan; // graph: one of desc
    int64_t ws_bytes;
    bool surveyed;
};

bool same_key(const plan_key &a, const plan_key &b) {
    return a.dir == b.dir && a.dt == b.dt && a.B == b.B && a.L == b.L && a.Hq == b.Hq &&
           a.Hkv == b.Hkv && a.D == b.D && a.ragged == b.ragged;
}

void entry_release(plan_entry *e) {
    if (e->plan) cudnnBackendDestroyDescriptor(e->plan);
    for (int i = e->ndesc - 1; i >= 0; i--) cudnnBackendDestroyDescriptor(e->desc[i]);
    memset(e, 0, sizeof *e);
}

// Builds descriptors into a plan entry, keeping the first failure (later
// calls are skipped once one has failed) and what it was.
struct builder {
    plan_entry *e;
    cudnnStatus_t st;
    const char *what;

    cudnnBackendDescriptor_t make(cudnnBackendDescriptorType_t t, const char *w) {
        cudnnBackendDescriptor_t d = nullptr;
        if (st) return nullptr;
        if (e->ndesc == MAX_DESC) {
            st = CUDNN_STATUS_INTERNAL_ERROR, what = "too many descriptors";
            return nullptr;
        }
        if ((st = cudnnBackendCreateDescriptor(t, &d)) != CUDNN_STATUS_SUCCESS) {
            what = w;
            return nullptr;
        }
        e->desc[e->ndesc++] = d;
        return d;
    }
    void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t a, cudnnBackendAttributeType_t t,
             int64_t n, const void *v, const char *w) {
        if (st) return;
        if ((st = cudnnBackendSetAttribute(d, a, t, n, v)) != CUDNN_STATUS_SUCCESS) what = w;
    }
    void link(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t a, cudnnBackendDescriptor_t v,
              const char *w) {
        set(d, a, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v, w);
    }
    void fin(cudnnBackendDescriptor_t d, const char *w) {
        if (st) return;
        if ((st = cudnnBackendFinalize(d)) != CUDNN_STATUS_SUCCESS) what = w;
    }

    cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t t, const int64_t (&dim)[4],
                                    const int64_t (&str)[4], bool virt, bool by_value = false,
                                    cudnnBackendDescriptor_t ragged = nullptr) {
        cudnnBackendDescriptor_t d = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
        const int64_t align = 16;
        set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &t, "tensor type");
        set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim, "tensor dims");
        set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str, "tensor strides");
        set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor id");
        set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
        if (virt) set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, "tensor virtual");
        if (by_value)
            set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor by value");
        if (ragged) link(d, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, ragged, "tensor ragged offset");
        fin(d, "tensor");
        return d;
    }
    // A scalar passed by value at execution (fp32).
    cudnnBackendDescriptor_t scalar(int64_t uid) {
        static const int64_t one[4] = {1, 1, 1, 1};
        return tensor(uid, CUDNN_DATA_FLOAT, one, one, false, true);
    }

    // y = mode(x[, b][, t]); axis >= 0 for GEN_INDEX.
    cudnnBackendDescriptor_t pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec,
                                       cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                                       cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                                       int64_t axis = -1) {
        cudnnBackendDescriptor_t p = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise");
        set(p, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
        set(p, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "pointwise precision");
        if (axis >= 0) set(p, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
        fin(p, "pointwise");
        cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise op");
        link(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, p, "pointwise op");
        link(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, "pointwise x");
        if (b) link(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, "pointwise b");
        if (t) link(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, "pointwise t");
        link(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, "pointwise y");
        fin(op, "pointwise op");
        return op;
    }
    cudnnBackendDescriptor_t reduce(cudnnReduceTensorOp_t how, cudnnBackendDescriptor_t x,
                                    cudnnBackendDescriptor_t y) {
        const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
        cudnnBackendDescriptor_t r = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
        set(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "reduction type");
        set(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &how,
            "reduction operator");
        fin(r, "reduction");
        cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction op");
        link(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, r, "reduction op");
        link(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, "reduction x");
        link(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, "reduction y");
        fin(op, "reduction op");
        return op;
    }
    // c = a b, with the ragged graphs' per-sequence bounds on M, N, K (or null)
    cudnnBackendDescriptor_t matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                                    cudnnBackendDescriptor_t c, cudnnBackendDescriptor_t mo = nullptr,
                                    cudnnBackendDescriptor_t no = nullptr,
                                    cudnnBackendDescriptor_t ko = nullptr) {
        const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
        cudnnBackendDescriptor_t m = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
        set(m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "matmul type");
        fin(m, "matmul");
        cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul op");
        link(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, "matmul a");
        link(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, "matmul b");
        link(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, "matmul c");
        link(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, m, "matmul op");
        if (mo) link(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, mo, "matmul M bound");
        if (no) link(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, no, "matmul N bound");
        if (ko) link(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, ko, "matmul K bound");
        fin(op, "matmul op");
        return op;
    }
    cudnnBackendDescriptor_t reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
        cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape op");
        link(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, "reshape x");
        link(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, "reshape y");
        fin(op, "reshape op");
        return op;
    }
};

// Shapes and strides of the graph tensors, and in the ragged graphs the
// per-sequence lengths and offsets every graph shares.
struct dims {
    int64_t B, L, Hq, Hkv, D;
    cudnnBackendDescriptor_t seq_q, seq_kv;         // [B] lengths (null: equal documents)
    cudnnBackendDescriptor_t off_q, off_kv, off_st; // [B + 1] element offsets, by layout
    // token-major (T, H, D) as [B, H, L, D]
    void rows(int64_t H, int64_t (&d)[4], int64_t (&s)[4]) const {
        d[0] = B, d[1] = H, d[2] = L, d[3] = D;
        s[0] = L * H * D, s[1] = D, s[2] = H * D, s[3] = 1;
    }
    // the same memory as [B, H, D, L] (K^T, V^T)
    void cols(int64_t H, int64_t (&d)[4], int64_t (&s)[4]) const {
        d[0] = B, d[1] = H, d[2] = D, d[3] = L;
        s[0] = L * H * D, s[1] = D, s[2] = 1, s[3] = H * D;
    }
    void scores(int64_t (&d)[4], int64_t (&s)[4], bool transposed = false) const {
        d[0] = B, d[1] = Hq, d[2] = L, d[3] = L;
        s[0] = Hq * L * L, s[1] = L * L, s[2] = transposed ? 1 : L, s[3] = transposed ? L : 1;
    }
    // [B, Hq, L, 1]: packed per head, or (ragged) token-major like loom's lse
    void per_row(int64_t (&d)[4], int64_t (&s)[4]) const {
        d[0] = B, d[1] = Hq, d[2] = L, d[3] = 1;
        if (seq_q)
            s[0] = Hq * L, s[1] = 1, s[2] = Hq, s[3] = 1;
        else
            s[0] = Hq * L, s[1] = L, s[2] = 1, s[3] = 1;
    }
    void packed(int64_t H, int64_t (&d)[4], int64_t (&s)[4]) const { // [B, H, L, D], packed
        d[0] = B, d[1] = H, d[2] = L, d[3] = D;
        s[0] = H * L * D, s[1] = L * D, s[2] = D, s[3] = 1;
    }
};

// Ragged graphs: the lengths and offsets, created once per graph.
void ragged_inputs(builder &g, dims &z) {
    const int64_t one[4] = {1, 1, 1, 1}, ds[4] = {z.B, 1, 1, 1}, dof[4] = {z.B + 1, 1, 1, 1};
    z.seq_q = g.tensor(U_SEQ_Q, CUDNN_DATA_INT32, ds, one, false);
    z.seq_kv = g.tensor(U_SEQ_KV, CUDNN_DATA_INT32, ds, one, false);
    z.off_q = g.tensor(U_OFF_Q, CUDNN_DATA_INT64, dof, one, false);
    z.off_kv = g.tensor(U_OFF_KV, CUDNN_DATA_INT64, dof, one, false);
    z.off_st = g.tensor(U_OFF_ST, CUDNN_DATA_INT64, dof, one, false);
}

// The causal mask on scores x (fp32, virtual): y = row >= col ? x : -inf.
cudnnBackendDescriptor_t causal_mask(builder &g, const dims &z, cudnnBackendDescriptor_t x,
                                     cudnnBackendDescriptor_t neg_inf, int64_t &uid,
                                     cudnnBackendDescriptor_t *ops, int &nops) {
    int64_t d[4], s[4];
    z.scores(d, s);
    cudnnBackendDescriptor_t row = g.tensor(uid++, CUDNN_DATA_INT32, d, s, true);
    cudnnBackendDescriptor_t col = g.tensor(uid++, CUDNN_DATA_INT32, d, s, true);
    cudnnBackendDescriptor_t keep = g.tensor(uid++, CUDNN_DATA_BOOLEAN, d, s, true);
    cudnnBackendDescriptor_t y = g.tensor(uid++, CUDNN_DATA_FLOAT, d, s, true);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, x, nullptr, nullptr, row, 2);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, x, nullptr, nullptr, col, 3);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x, neg_inf, keep, y);
    return y;
}

// Ragged graphs, before the causal mask: y = row < len_q && col < len_kv ? x : -inf.
cudnnBackendDescriptor_t padding_mask(builder &g, const dims &z, cudnnBackendDescriptor_t x,
                                      cudnnBackendDescriptor_t neg_inf, int64_t &uid,
                                      cudnnBackendDescriptor_t *ops, int &nops) {
    int64_t d[4], s[4];
    z.scores(d, s);
    const cudnnDataType_t i32 = CUDNN_DATA_INT32, b8 = CUDNN_DATA_BOOLEAN;
    cudnnBackendDescriptor_t row = g.tensor(uid++, i32, d, s, true), col = g.tensor(uid++, i32, d, s, true);
    cudnnBackendDescriptor_t rk = g.tensor(uid++, b8, d, s, true), ck = g.tensor(uid++, b8, d, s, true);
    cudnnBackendDescriptor_t keep = g.tensor(uid++, b8, d, s, true);
    cudnnBackendDescriptor_t y = g.tensor(uid++, CUDNN_DATA_FLOAT, d, s, true);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, i32, x, nullptr, nullptr, row, 2);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, i32, x, nullptr, nullptr, col, 3);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_CMP_LT, b8, row, z.seq_q, nullptr, rk);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_CMP_LT, b8, col, z.seq_kv, nullptr, ck);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, b8, rk, ck, nullptr, keep);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x, neg_inf, keep, y);
    return y;
}

// Forward: Q, K^T, V -> O and Stats.
int build_fwd(builder &g, const dims &z, cudnnDataType_t io, cudnnBackendDescriptor_t *ops) {
    int nops = 0;
    int64_t uid = U_VIRTUAL, d[4], s[4];
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    z.rows(z.Hq, d, s);
    cudnnBackendDescriptor_t q = g.tensor(U_Q, io, d, s, false, false, z.off_q);
    cudnnBackendDescriptor_t o = g.tensor(U_O, io, d, s, false, false, z.off_q);
    z.cols(z.Hkv, d, s);
    cudnnBackendDescriptor_t kt = g.tensor(U_KT, io, d, s, false, false, z.off_kv);
    z.rows(z.Hkv, d, s);
    cudnnBackendDescriptor_t v = g.tensor(U_V, io, d, s, false, false, z.off_kv);
    z.per_row(d, s);
    cudnnBackendDescriptor_t stats = g.tensor(U_STATS, f32, d, s, false, false, z.off_st);
    d[0] = z.B, d[1] = z.Hq, d[2] = z.L, d[3] = 1, s[0] = z.Hq * z.L, s[1] = z.L, s[2] = 1, s[3] = 1;
    cudnnBackendDescriptor_t mx = g.tensor(uid++, f32, d, s, true), sum = g.tensor(uid++, f32, d, s, true),
                             lg = g.tensor(uid++, f32, d, s, true);
    cudnnBackendDescriptor_t scale = g.scalar(U_SCALE), neg_inf = g.scalar(U_NEG_INF);
    z.scores(d, s);
    cudnnBackendDescriptor_t sc = g.tensor(uid++, f32, d, s, true), ss = g.tensor(uid++, f32, d, s, true);
    cudnnBackendDescriptor_t sub = g.tensor(uid++, f32, d, s, true), ex = g.tensor(uid++, f32, d, s, true);
    cudnnBackendDescriptor_t p = g.tensor(uid++, io, d, s, true);

    ops[nops++] = g.matmul(q, kt, sc, z.seq_q, z.seq_kv);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_MUL, f32, sc, scale, nullptr, ss);
    cudnnBackendDescriptor_t sm = ss;
    if (z.seq_q) sm = padding_mask(g, z, sm, neg_inf, uid, ops, nops);
    sm = causal_mask(g, z, sm, neg_inf, uid, ops, nops);
    ops[nops++] = g.reduce(CUDNN_REDUCE_TENSOR_MAX, sm, mx);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_SUB, f32, sm, mx, nullptr, sub);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_EXP, f32, sub, nullptr, nullptr, ex);
    ops[nops++] = g.reduce(CUDNN_REDUCE_TENSOR_ADD, ex, sum);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_LOG, f32, sum, nullptr, nullptr, lg);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_ADD, f32, mx, lg, nullptr, stats);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_DIV, f32, ex, sum, nullptr, p);
    ops[nops++] = g.matmul(p, v, o, z.seq_q, nullptr, z.seq_kv);
    return nops;
}

// Backward: Q, K^T, V^T, O, dO, Stats -> dQ, dK, dV (and the fp32 softmax_sum
// and dQ accumulator, and in the ragged grouped graph the per-query-head dK
// and dV, given as buffers). pad_first: the ragged graph's padding mask
// before subtracting Stats (an older form of the pattern).
int build_bwd(builder &g, const dims &z, cudnnDataType_t io, bool pad_first,
              cudnnBackendDescriptor_t *ops) {
    int nops = 0;
    int64_t uid = U_VIRTUAL, d[4], s[4];
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    const bool grouped = z.Hq != z.Hkv, ragged = z.seq_q != nullptr;
    z.rows(z.Hq, d, s);
    cudnnBackendDescriptor_t q = g.tensor(U_Q, io, d, s, false, false, z.off_q);
    cudnnBackendDescriptor_t o = g.tensor(U_O, io, d, s, false, false, z.off_q);
    cudnnBackendDescriptor_t dout = g.tensor(U_DO, io, d, s, false, false, z.off_q);
    cudnnBackendDescriptor_t dq = g.tensor(U_DQ, io, d, s, false, false, z.off_q);
    // dO * O, with the strides the frontend gives it
    int64_t dos[4] = {z.Hq * z.L * z.D, z.L * z.D, z.Hq * z.D, 1};
    cudnnBackendDescriptor_t doo = g.tensor(uid++, f32, d, dos, true);
    // per query head dK, dV under grouped heads: ragged, buffers laid out as
    // dQ (dK's offsets, which cuDNN scales by Hq / Hkv)
    cudnnBackendDescriptor_t dv_h = nullptr, dk_h = nullptr;
    if (grouped && ragged) {
        dv_h = g.tensor(U_DV_FULL, io, d, s, false, false, z.off_kv);
        dk_h = g.tensor(U_DK_FULL, io, d, s, false, false, z.off_kv);
    } else if (grouped) {
        dv_h = g.tensor(uid++, io, d, s, true), dk_h = g.tensor(uid++, io, d, s, true);
    }
    cudnnBackendDescriptor_t dq_acc;
    if (ragged) { // dQ's layout and offsets, fp32
        dq_acc = g.tensor(U_DQ_ACC, f32, d, s, false, false, z.off_q);
    } else {
        z.packed(z.Hq, d, s);
        dq_acc = g.tensor(U_DQ_ACC, f32, d, s, false);
    }
    z.cols(z.Hkv, d, s);
    cudnnBackendDescriptor_t kt = g.tensor(U_KT, io, d, s, false, false, z.off_kv);
    cudnnBackendDescriptor_t vt = g.tensor(U_VT, io, d, s, false, false, z.off_kv);
    z.rows(z.Hkv, d, s);
    cudnnBackendDescriptor_t dk = g.tensor(U_DK, io, d, s, false, false, z.off_kv);
    cudnnBackendDescriptor_t dv = g.tensor(U_DV, io, d, s, false, false, z.off_kv);
    if (ragged)
        z.rows(z.Hkv, d, s);
    else
        z.packed(z.Hkv, d, s);
    cudnnBackendDescriptor_t k32 = g.tensor(uid++, f32, d, s, true, false, z.off_kv);
    z.per_row(d, s);
    cudnnBackendDescriptor_t stats = g.tensor(U_STATS, f32, d, s, false, false, z.off_st);
    cudnnBackendDescriptor_t ssum = g.tensor(U_SOFTMAX_SUM, f32, d, s, false, false, z.off_st);
    d[0] = z.B, d[1] = z.Hq, d[2] = z.L, d[3] = 1, s[0] = z.Hq * z.L, s[1] = z.L, s[2] = 1, s[3] = 1;
    cudnnBackendDescriptor_t rsum = g.tensor(uid++, f32, d, s, true);
    cudnnBackendDescriptor_t scale = g.scalar(U_SCALE), neg_inf = g.scalar(U_NEG_INF), one = g.scalar(U_ONE);
    z.scores(d, s);
    cudnnBackendDescriptor_t sc = g.tensor(uid++, f32, d, s, true), ss = g.tensor(uid++, f32, d, s, true);
    cudnnBackendDescriptor_t sub = g.tensor(uid++, f32, d, s, true), p = g.tensor(uid++, f32, d, s, true);
    cudnnBackendDescriptor_t dp = g.tensor(uid++, f32, d, s, true), dps = g.tensor(uid++, f32, d, s, true);
    cudnnBackendDescriptor_t ds0 = g.tensor(uid++, f32, d, s, true), ds = g.tensor(uid++, f32, d, s, true);
    z.scores(d, s, true);
    cudnnBackendDescriptor_t pt = g.tensor(uid++, io, d, s, true), dst = g.tensor(uid++, io, d, s, true);

    // softmax_sum = rowsum(dO * O) * 1
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_MUL, f32, dout, o, nullptr, doo);
    ops[nops++] = g.reduce(CUDNN_REDUCE_TENSOR_ADD, doo, rsum);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_MUL, f32, rsum, one, nullptr, ssum);
    // P = exp(mask(Q K^T * scale - Stats))
    ops[nops++] = g.matmul(q, kt, sc, z.seq_q, z.seq_kv);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_MUL, f32, sc, scale, nullptr, ss);
    cudnnBackendDescriptor_t sm = ss;
    if (ragged && pad_first) sm = padding_mask(g, z, sm, neg_inf, uid, ops, nops);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_SUB, f32, sm, stats, nullptr, sub);
    sm = sub;
    if (ragged && !pad_first) sm = padding_mask(g, z, sm, neg_inf, uid, ops, nops);
    sm = causal_mask(g, z, sm, neg_inf, uid, ops, nops);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_EXP, f32, sm, nullptr, nullptr, p);
    // dV = P^T dO (per query head, then over each group)
    ops[nops++] = g.reshape(p, pt);
    ops[nops++] = g.matmul(pt, dout, grouped ? dv_h : dv, z.seq_kv, nullptr, z.seq_q);
    if (grouped) ops[nops++] = g.reduce(CUDNN_REDUCE_TENSOR_ADD, dv_h, dv);
    // dS = P (dO V^T - softmax_sum) * scale
    ops[nops++] = g.matmul(dout, vt, dp, z.seq_q, z.seq_kv);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_SUB, f32, dp, ssum, nullptr, dps);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_MUL, f32, dps, p, nullptr, ds0);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_MUL, f32, ds0, scale, nullptr, ds);
    // dK = dS^T Q
    ops[nops++] = g.reshape(ds, dst);
    ops[nops++] = g.matmul(dst, q, grouped ? dk_h : dk, z.seq_kv, nullptr, z.seq_q);
    if (grouped) ops[nops++] = g.reduce(CUDNN_REDUCE_TENSOR_ADD, dk_h, dk);
    // dQ = dS K in fp32, then rounded
    ops[nops++] = g.reshape(kt, k32);
    ops[nops++] = g.matmul(ds, k32, dq_acc, z.seq_q, nullptr, z.seq_kv);
    ops[nops++] = g.pointwise(CUDNN_POINTWISE_IDENTITY, f32, dq_acc, nullptr, nullptr, dq);
    return nops;
}

} // namespace

struct loom_cuda_attn_handle {
    cudnnHandle_t h;
    plan_entry cache[CACHE];
    int next;                // the slot a new shape replaces when all are used
    long long calls[2];      // forward and backward calls run through cuDNN
    char why[320];           // why cuDNN last refused a shape ("" if it never did)
    FILE *survey;            // loom_cuda_attn_survey: time every engine config here
};

namespace {

// "what: cuDNN's status (its last error message)".
void describe(char *buf, size_t n, const char *what, cudnnStatus_t st) {
    char last[256] = "";
    cudnnGetLastErrorString(last, sizeof last);
    snprintf(buf, n, "%s: %s%s%s", what ? what : "cuDNN", cudnnGetErrorString(st), last[0] ? " (" : "",
             last[0] ? last : "");
    if (last[0]) strncat(buf, ")", n - strlen(buf) - 1);
}

// The execution plan of one engine config and its workspace (*p nullptr, and
// cuDNN's status, where it refuses the config).
cudnnStatus_t plan_for(cudnnBackendDescriptor_t cfg, cudnnBackendDescriptor_t *p, int64_t *ws) {
    *p = nullptr;
    cudnnStatus_t st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, p);
    if (st) return st;
    st = cudnnBackendSetAttribute(*p, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg);
    if (!st) st = cudnnBackendFinalize(*p);
    if (!st) st = cudnnBackendGetAttribute(*p, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, nullptr, ws);
    if (st) cudnnBackendDestroyDescriptor(*p), *p = nullptr;
    return st;
}

// Builds the graph for key k (variant: see build_bwd's pad_first) and the
// first plan of cuDNN's heuristics that finalizes. On failure the entry is
// marked refused, with the reason in h->why.
void build_plan_variant(loom_cuda_attn_handle *h, const plan_key &k, plan_entry *e, bool variant) {
    memset(e, 0, sizeof *e);
    e->used = true, e->key = k;
    builder g = {e, CUDNN_STATUS_SUCCESS, nullptr};
    dims z = {k.B, k.L, k.Hq, k.Hkv, k.D, nullptr, nullptr, nullptr, nullptr, nullptr};
    if (k.ragged) ragged_inputs(g, z);
    const cudnnDataType_t io = k.dt == LOOM_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
    cudnnBackendDescriptor_t ops[48];
    const int nops = k.dir == FWD ? build_fwd(g, z, io, ops) : build_bwd(g, z, io, variant, ops);
    cudnnBackendDescriptor_t graph = g.make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    g.set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, nops, ops, "graph ops");
    g.set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h->h, "graph handle");
    g.fin(graph, "operation graph");
    e->graph = graph;
    cudnnBackendDescriptor_t heur = g.make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    g.link(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "heuristics graph");
    g.set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
    g.fin(heur, "heuristics");
    int64_t n = 0;
    if (!g.st && (g.st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr)))
        g.what = "heuristics results";
    if (n > 8) n = 8;
    cudnnBackendDescriptor_t cfg[8];
    for (int64_t i = 0; i < n; i++) cfg[i] = g.make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
    if (!g.st && n > 0 &&
        (g.st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                         CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &n, cfg)))
        g.what = "heuristics results";
    cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
    for (int64_t i = 0; i < n && !g.st && !e->plan; i++) last = plan_for(cfg[i], &e->plan, &e->ws_bytes);
    if (!g.st && !e->plan) g.st = last, g.what = n ? "every engine config" : "no engine for the graph";
    if (g.st) {
        describe(h->why, sizeof h->why, g.what, g.st);
        const plan_key kk = e->key;
        entry_release(e);
        e->used = true, e->refused = true, e->key = kk;
    }
}

void build_plan(loom_cuda_attn_handle *h, const plan_key &k, plan_entry *e) {
    build_plan_variant(h, k, e, false);
    if (e->refused && k.ragged && k.dir == BWD) build_plan_variant(h, k, e, true);
}

// A finalized variant pack of n tensors (uids, ptrs) and the workspace ws;
// *vp is the caller's to destroy (nullptr when its creation failed).
cudnnStatus_t variant_pack(const int64_t *uids, void *const *ptrs, int n, void *ws,
                           cudnnBackendDescriptor_t *vp) {
    *vp = nullptr;
    cudnnStatus_t st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, vp);
    if (!st) st = cudnnBackendSetAttribute(*vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    if (!st) st = cudnnBackendSetAttribute(*vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
    if (!st) st = cudnnBackendSetAttribute(*vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    if (!st) st = cudnnBackendFinalize(*vp);
    return st;
}

// ---- the survey (loom_cuda_attn_survey): every engine config, timed ----

// "engine E knob=value ..." of an engine config.
void cfg_name(cudnnBackendDescriptor_t cfg, char *buf, size_t n) {
    cudnnBackendDescriptor_t eng = nullptr, ch[32] = {};
    int64_t gi = -1, got = 0, nk = 0;
    snprintf(buf, n, "?");
    if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &eng)) return;
    if (!cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                  &got, &eng))
        cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &got, &gi);
    cudnnBackendDestroyDescriptor(eng);
    int at = snprintf(buf, n, "engine %lld", (long long)gi);
    for (int i = 0; i < 32; i++) cudnnBackendCreateDescriptor(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, &ch[i]);
    if (!cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                  32, &nk, ch))
        for (int64_t i = 0; i < nk && at < (int)n; i++) {
            cudnnBackendKnobType_t t = CUDNN_KNOB_TYPE_COUNTS;
            int64_t v = 0;
            cudnnBackendGetAttribute(ch[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &got, &t);
            cudnnBackendGetAttribute(ch[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &got, &v);
            at += snprintf(buf + at, n - at, " k%d=%lld", (int)t, (long long)v);
        }
    for (int i = 0; i < 32; i++) cudnnBackendDestroyDescriptor(ch[i]);
}

struct survey_io {
    const int64_t *uids;
    void *const *ptrs;
    int n;
    void *rezero;       // the backward's dQ accumulator, cleared before every run
    size_t rezero_bytes;
    void *out[3];       // the outputs compared with the chosen plan's
    size_t out_bytes[3];
};

// Runs plan p (workspace ws) reps times; the mean ms, or -1 when it fails.
float time_plan(loom_cuda_attn_handle *h, cudnnBackendDescriptor_t p, const survey_io &io, void *ws,
                cudaStream_t s, int reps) {
    cudnnBackendDescriptor_t vp;
    cudnnStatus_t st = variant_pack(io.uids, io.ptrs, io.n, ws, &vp);
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    float ms = -1;
    for (int r = -1; r < reps && !st; r++) { // r = -1: the warm-up, not timed
        if (r == 0) cudaEventRecord(e0, s);
        if (io.rezero) cudaMemsetAsync(io.rezero, 0, io.rezero_bytes, s);
        st = cudnnBackendExecute(h->h, p, vp);
    }
    if (!st) {
        cudaEventRecord(e1, s);
        if (cudaEventSynchronize(e1) == cudaSuccess) cudaEventElapsedTime(&ms, e0, e1), ms /= reps;
    }
    cudaStreamSynchronize(s);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    if (vp) cudnnBackendDestroyDescriptor(vp);
    return st ? -1 : ms;
}

// The outputs (16-bit floats) widened to float on the host.
void out_copy(const survey_io &io, loom_dtype dt, std::vector<float> *ref) {
    for (int i = 0; i < 3 && io.out[i]; i++) {
        const size_t n = io.out_bytes[i] / 2;
        std::vector<uint16_t> b(n);
        cudaMemcpy(b.data(), io.out[i], n * 2, cudaMemcpyDeviceToHost);
        ref[i].resize(n);
        for (size_t j = 0; j < n; j++)
            ref[i][j] = dt == LOOM_BF16 ? __bfloat162float(__ushort_as_bfloat16(b[j]))
                                        : __half2float(__ushort_as_half(b[j]));
    }
}

// The largest |a - b| over the outputs, against ref.
double out_diff(const survey_io &io, loom_dtype dt, const std::vector<float> *ref) {
    std::vector<float> got[3];
    out_copy(io, dt, got);
    double worst = 0;
    for (int i = 0; i < 3 && io.out[i]; i++)
        for (size_t j = 0; j < got[i].size(); j++) {
            const double d = fabs((double)got[i][j] - (double)ref[i][j]);
            if (!(d <= worst)) worst = d; // NaN stays
        }
    return worst;
}

// Every engine of e's graph, with each of its knobs' values (all combinations
// up to 128 an engine, else one knob at a time), timed on this call's own
// buffers against the plan the heuristics chose, with the largest output
// difference. Printed to h->survey; the plan is unchanged.
void survey(loom_cuda_attn_handle *h, plan_entry *e, const survey_io &io, cudaStream_t s) {
    FILE *f = h->survey;
    const plan_key &k = e->key;
    const int reps = 5;
    fprintf(f, "cudnn survey: %s B=%lld L=%lld Hq=%lld Hkv=%lld D=%lld\n", k.dir == FWD ? "forward" : "backward",
            (long long)k.B, (long long)k.L, (long long)k.Hq, (long long)k.Hkv, (long long)k.D);
    std::vector<float> ref[3];
    void *ws = nullptr;
    if (cudaMalloc(&ws, (size_t)e->ws_bytes + 16) != cudaSuccess) return;
    const float base = time_plan(h, e->plan, io, ws, s, reps);
    cudaFree(ws);
    out_copy(io, k.dt, ref);
    {
        cudnnBackendDescriptor_t cfg = nullptr;
        int64_t got = 0;
        char name[256] = "?";
        if (!cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfg) &&
            !cudnnBackendGetAttribute(e->plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                      CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got, &cfg))
            cfg_name(cfg, name, sizeof name);
        if (cfg) cudnnBackendDestroyDescriptor(cfg);
        fprintf(f, "cudnn survey:   heuristics' choice: %s  %.4f ms  ws %lld B\n", name, base,
                (long long)e->ws_bytes);
    }
    int64_t count = 0, got = 0;
    cudnnBackendGetAttribute(e->graph, CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT, CUDNN_TYPE_INT64,
                             1, &got, &count);
    for (int64_t gi = 0; gi < count; gi++) {
        cudnnBackendDescriptor_t eng = nullptr;
        if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &eng)) continue;
        cudnnBackendSetAttribute(eng, CUDNN_ATTR_ENGINE_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &e->graph);
        cudnnBackendSetAttribute(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &gi);
        if (cudnnBackendFinalize(eng)) {
            cudnnBackendDestroyDescriptor(eng);
            continue;
        }
        cudnnBackendDescriptor_t info[32] = {};
        int64_t nk = 0;
        for (int i = 0; i < 32; i++) cudnnBackendCreateDescriptor(CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR, &info[i]);
        cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_KNOB_INFO, CUDNN_TYPE_BACKEND_DESCRIPTOR, 32, &nk, info);
        cudnnBackendKnobType_t kt[32];
        int64_t lo[32], hi[32], step[32], combos = 1;
        int nv = 0; // knobs with more than one value
        fprintf(f, "cudnn survey:   engine %lld:", (long long)gi);
        for (int64_t i = 0; i < nk; i++) {
            cudnnBackendKnobType_t t = CUDNN_KNOB_TYPE_COUNTS;
            int64_t a = 0, b = 0, c = 1;
            cudnnBackendGetAttribute(info[i], CUDNN_ATTR_KNOB_INFO_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &got, &t);
            cudnnBackendGetAttribute(info[i], CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE, CUDNN_TYPE_INT64, 1, &got, &a);
            cudnnBackendGetAttribute(info[i], CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE, CUDNN_TYPE_INT64, 1, &got, &b);
            cudnnBackendGetAttribute(info[i], CUDNN_ATTR_KNOB_INFO_STRIDE, CUDNN_TYPE_INT64, 1, &got, &c);
            fprintf(f, " k%d in [%lld, %lld] by %lld", (int)t, (long long)a, (long long)b, (long long)c);
            if (c < 1) c = 1;
            if (b > a) {
                kt[nv] = t, lo[nv] = a, hi[nv] = b, step[nv] = c, nv++;
                combos *= (b - a) / c + 1;
                if (combos > 1000000) combos = 1000000;
            }
        }
        fprintf(f, "\n");
        for (int i = 0; i < 32; i++) cudnnBackendDestroyDescriptor(info[i]);
        // the candidates: all combinations, or the engine's defaults and then
        // each knob's values alone
        const bool all = combos <= 128;
        int64_t ncand = 1;
        if (all) ncand = combos;
        else
            for (int i = 0; i < nv; i++) ncand += (hi[i] - lo[i]) / step[i] + 1;
        for (int64_t ci = 0; ci < ncand && ci < 400; ci++) {
            cudnnBackendDescriptor_t ch[32] = {};
            int nch = 0;
            if (all) {
                int64_t rest = ci;
                for (int i = 0; i < nv; i++) {
                    const int64_t m = (hi[i] - lo[i]) / step[i] + 1;
                    const int64_t v = lo[i] + (rest % m) * step[i];
                    rest /= m;
                    cudnnBackendCreateDescriptor(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, &ch[nch]);
                    cudnnBackendSetAttribute(ch[nch], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &kt[i]);
                    cudnnBackendSetAttribute(ch[nch], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &v);
                    cudnnBackendFinalize(ch[nch++]);
                }
            } else if (ci > 0) {
                int64_t rest = ci - 1;
                int i = 0;
                while (rest >= (hi[i] - lo[i]) / step[i] + 1) rest -= (hi[i] - lo[i]) / step[i] + 1, i++;
                const int64_t v = lo[i] + rest * step[i];
                cudnnBackendCreateDescriptor(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, &ch[nch]);
                cudnnBackendSetAttribute(ch[nch], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &kt[i]);
                cudnnBackendSetAttribute(ch[nch], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &v);
                cudnnBackendFinalize(ch[nch++]);
            }
            cudnnBackendDescriptor_t cfg = nullptr;
            cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfg);
            cudnnBackendSetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &eng);
            if (nch) cudnnBackendSetAttribute(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, nch, ch);
            int64_t wsb = 0;
            cudnnBackendDescriptor_t p = nullptr;
            if (!cudnnBackendFinalize(cfg)) plan_for(cfg, &p, &wsb);
            if (p) {
                char name[256];
                cfg_name(cfg, name, sizeof name);
                void *w = nullptr;
                float ms = -1;
                double diff = -1;
                if (cudaMalloc(&w, (size_t)wsb + 16) == cudaSuccess) {
                    ms = time_plan(h, p, io, w, s, reps);
                    cudaFree(w);
                    if (ms >= 0) diff = out_diff(io, k.dt, ref);
                }
                fprintf(f, "cudnn survey:     %-60s %.4f ms (%.3fx)  diff %.3g  ws %lld B\n", name, ms,
                        ms > 0 ? base / ms : 0.0, diff, (long long)wsb);
                fflush(f);
                cudnnBackendDestroyDescriptor(p);
            }
            cudnnBackendDestroyDescriptor(cfg);
            for (int i = 0; i < nch; i++) cudnnBackendDestroyDescriptor(ch[i]);
        }
        cudnnBackendDestroyDescriptor(eng);
    }
    cudaGetLastError(); // a refused candidate's launch error is not the caller's
}

plan_entry *find_plan(loom_cuda_attn_handle *h, const plan_key &k) {
    for (int i = 0; i < CACHE; i++)
        if (h->cache[i].used && same_key(h->cache[i].key, k)) return &h->cache[i];
    plan_entry *e = &h->cache[h->next];
    h->next = (h->next + 1) % CACHE;
    entry_release(e);
    build_plan(h, k, e);
    return e;
}

loom_status run_plan(loom_ctx *ctx, loom_cuda_attn_handle *h, plan_entry *e, const int64_t *uids,
                     void *const *ptrs, int n, void *ws, cudaStream_t s, const char *op) {
    cudnnStatus_t st = cudnnSetStream(h->h, s);
    cudnnBackendDescriptor_t vp = nullptr;
    const char *what = "set stream";
    if (!st) what = "variant pack", st = variant_pack(uids, ptrs, n, ws, &vp);
    if (!st) what = "execute", st = cudnnBackendExecute(h->h, e->plan, vp);
    if (vp) cudnnBackendDestroyDescriptor(vp);
    if (!st) return LOOM_OK;
    char msg[320];
    describe(msg, sizeof msg, what, st);
    return loom_errf(ctx, LOOM_ERR_DEVICE, "cuda %s (cuDNN): %s", op, msg);
}

// lse (T, Hq) <-> stats (B, Hq, L).
__global__ void stats_layout_kernel(const float *src, float *dst, int64_t B, int64_t L, int64_t Hq,
                                    bool to_lse) {
    const int64_t n = B * L * Hq;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t h = i % Hq, t = i / Hq, b = t / L, l = t % L;
        const int64_t j = (b * Hq + h) * L + l;
        if (to_lse)
            dst[i] = src[j];
        else
            dst[j] = src[i];
    }
}

// Ragged graphs: the lengths (0 past the documents) and each layout's
// element offsets (the end of the last document past them) from cu_seqlens.
__global__ void ragged_kernel(const int32_t *cu, int64_t ndocs, int64_t B, int64_t wq, int64_t wkv,
                              int64_t wst, int32_t *seq, int64_t *off_q, int64_t *off_kv,
                              int64_t *off_st) {
    for (int64_t b = threadIdx.x; b <= B; b += blockDim.x) {
        const int64_t c = cu[b < ndocs ? b : ndocs];
        if (b < B) seq[b] = b < ndocs ? cu[b + 1] - cu[b] : 0;
        off_q[b] = c * wq, off_kv[b] = c * wkv, off_st[b] = c * wst;
    }
}

// Whether cuDNN can be asked at all (the engines take BF16/F16, head sizes
// that are multiples of 8 up to 128, 16-byte aligned tensors), and the
// graph's B and L: equal documents (L > 0) B = T / L; else the ragged graph,
// B the document count rounded up to 32 or a power of 2 up to 512, L = T.
bool shape_of(loom_dtype dt, int64_t T, int64_t L, int64_t ndocs, int64_t Hq, int64_t Hkv,
              int64_t D, const void *const *p, int np, int64_t *B, int64_t *Lg) {
    if ((dt != LOOM_BF16 && dt != LOOM_F16) || D % 8 != 0 || D > 256 || L < 0) return false;
    if (Hkv < 1 || Hq % Hkv != 0 || T < 1) return false;
    for (int i = 0; i < np; i++)
        if (!aligned16(p[i])) return false;
    if (L > 0) {
        if (T % L) return false;
        *B = T / L, *Lg = L;
        return true;
    }
    if (ndocs < 1 || ndocs > 512) return false;
    int64_t b = 32;
    while (b < ndocs) b *= 2;
    *B = b, *Lg = T;
    return true;
}

// Carves 16-byte aligned pieces off one scratch allocation.
struct carve {
    char *base;
    size_t at;
    void *take(size_t bytes) {
        void *p = base + at;
        at += (bytes + 15) & ~(size_t)15;
        return p;
    }
};

} // namespace

extern "C" loom_status loom_cuda_attn_create(loom_ctx *ctx, loom_cuda_attn_handle **out) {
    *out = NULL;
    loom_cuda_attn_handle *h = (loom_cuda_attn_handle *)calloc(1, sizeof *h);
    if (!h) return loom_errf(ctx, LOOM_ERR_OOM, "cuda attention: out of host memory for the handle");
    cudnnStatus_t st = cudnnCreate(&h->h);
    if (st) {
        free(h);
        return loom_errf(ctx, LOOM_ERR_DEVICE, "cuda attention: cudnnCreate: %s", cudnnGetErrorString(st));
    }
    *out = h;
    return LOOM_OK;
}

extern "C" void loom_cuda_attn_free(loom_cuda_attn_handle *h) {
    if (!h) return;
    for (int i = 0; i < CACHE; i++) entry_release(&h->cache[i]);
    cudnnDestroy(h->h);
    free(h);
}

extern "C" void loom_cuda_attn_survey(loom_cuda_attn_handle *h, FILE *out) {
    if (h) h->survey = out;
}

extern "C" void loom_cuda_attn_counts(const loom_cuda_attn_handle *h, long long *fwd, long long *bwd,
                                      const char **why) {
    if (fwd) *fwd = h ? h->calls[FWD] : 0;
    if (bwd) *bwd = h ? h->calls[BWD] : 0;
    if (why) *why = h ? h->why : "";
}

extern "C" loom_status loom_cuda_attention_cudnn_fwd(loom_ctx *ctx, loom_cuda_attn_handle *h,
                                                     const void *q, const void *k, const void *v,
                                                     loom_dtype dtype, int64_t T, int64_t Hq,
                                                     int64_t Hkv, int64_t D, const int32_t *cu_seqlens,
                                                     int64_t ndocs, int64_t L, float scale,
                                                     void *out, float *lse, void *stream, bool *taken) {
    *taken = false;
    const void *p[4] = {q, k, v, out};
    int64_t B, Lg;
    if (!h || !shape_of(dtype, T, L, ndocs, Hq, Hkv, D, p, 4, &B, &Lg)) return LOOM_OK;
    const bool ragged = L == 0;
    const plan_key key = {FWD, dtype, B, Lg, Hq, Hkv, D, ragged};
    plan_entry *e = find_plan(h, key);
    if (e->refused) return LOOM_OK;
    const cudaStream_t s = as_stream(stream);
    /* equal documents: cuDNN's stats, transposed into lse after; ragged: the
     * lengths and offsets (stats go straight into lse) */
    const size_t nst = ragged ? 0 : (size_t)T * Hq;
    const size_t bytes = nst * sizeof(float) + (size_t)B * 4 + 3 * (size_t)(B + 1) * 8 + 5 * 16 +
                         (size_t)e->ws_bytes;
    void *scratch = nullptr;
    loom_status st = check(ctx, cudaMallocAsync(&scratch, bytes, s), "attention_fwd (cuDNN scratch)");
    if (st) return st;
    carve c = {(char *)scratch, 0};
    float *stats = ragged ? lse : (float *)c.take(nst * sizeof(float));
    int32_t *seq = (int32_t *)c.take((size_t)B * 4);
    int64_t *off_q = (int64_t *)c.take((size_t)(B + 1) * 8), *off_kv = (int64_t *)c.take((size_t)(B + 1) * 8);
    int64_t *off_st = (int64_t *)c.take((size_t)(B + 1) * 8);
    void *ws = c.take((size_t)e->ws_bytes);
    if (ragged) {
        ragged_kernel<<<1, 256, 0, s>>>(cu_seqlens, ndocs, B, Hq * D, Hkv * D, Hq, seq, off_q, off_kv, off_st);
        st = check_launch(ctx, "attention_fwd");
    }
    float neg_inf = -INFINITY;
    const int64_t uids[12] = {U_Q,       U_KT,     U_V,      U_O,      U_STATS,  U_SCALE,
                              U_NEG_INF, U_SEQ_Q,  U_SEQ_KV, U_OFF_Q,  U_OFF_KV, U_OFF_ST};
    void *const ptrs[12] = {(void *)q, (void *)k, (void *)v, out,   stats,  &scale,
                            &neg_inf,  seq,       seq,       off_q, off_kv, off_st};
    if (!st && h->survey && !e->surveyed && !ragged) {
        e->surveyed = true;
        const survey_io io = {uids, ptrs, 7, nullptr, 0, {out}, {(size_t)T * Hq * D * loom_dtype_size(dtype)}};
        survey(h, e, io, s);
    }
    if (!st) st = run_plan(ctx, h, e, uids, ptrs, ragged ? 12 : 7, ws, s, "attention_fwd");
    if (!st && !ragged) {
        stats_layout_kernel<<<grid_for((int64_t)nst, 256), 256, 0, s>>>(stats, lse, B, Lg, Hq, true);
        st = check_launch(ctx, "attention_fwd");
    }
    loom_status sf = check(ctx, cudaFreeAsync(scratch, s), "attention_fwd (cuDNN scratch)");
    if (!st && !sf) h->calls[FWD]++, *taken = true;
    return st ? st : sf;
}

extern "C" loom_status loom_cuda_attention_cudnn_bwd(loom_ctx *ctx, loom_cuda_attn_handle *h,
                                                     const void *dout, const void *q, const void *k,
                                                     const void *v, const void *out, const float *lse,
                                                     loom_dtype dtype, int64_t T, int64_t Hq,
                                                     int64_t Hkv, int64_t D, const int32_t *cu_seqlens,
                                                     int64_t ndocs, int64_t L, float scale, void *dq,
                                                     void *dk, void *dv, void *stream, bool *taken) {
    *taken = false;
    const void *p[8] = {dout, q, k, v, out, dq, dk, dv};
    int64_t B, Lg;
    if (!h || !shape_of(dtype, T, L, ndocs, Hq, Hkv, D, p, 8, &B, &Lg)) return LOOM_OK;
    const bool ragged = L == 0, full = ragged && Hq != Hkv;
    const plan_key key = {BWD, dtype, B, Lg, Hq, Hkv, D, ragged};
    plan_entry *e = find_plan(h, key);
    if (e->refused) return LOOM_OK;
    const cudaStream_t s = as_stream(stream);
    /* the fp32 dQ (T * Hq * D), softmax_sum and (equal documents) the stats
     * (T * Hq each), the per-query-head dK and dV (ragged, grouped), the
     * lengths and offsets, the plan's workspace */
    const size_t nst = (size_t)T * Hq, nacc = nst * (size_t)D, esz = loom_dtype_size(dtype);
    const size_t bytes = (nacc + 2 * nst) * sizeof(float) + (full ? 2 * nacc * esz : 0) +
                         (size_t)B * 4 + 3 * (size_t)(B + 1) * 8 + 9 * 16 + (size_t)e->ws_bytes;
    void *scratch = nullptr;
    loom_status st = check(ctx, cudaMallocAsync(&scratch, bytes, s), "attention_bwd (cuDNN scratch)");
    if (st) return st;
    carve c = {(char *)scratch, 0};
    float *acc = (float *)c.take(nacc * sizeof(float)), *ssum = (float *)c.take(nst * sizeof(float));
    float *stats = ragged ? (float *)lse : (float *)c.take(nst * sizeof(float));
    void *dk_full = full ? c.take(nacc * esz) : nullptr, *dv_full = full ? c.take(nacc * esz) : nullptr;
    int32_t *seq = (int32_t *)c.take((size_t)B * 4);
    int64_t *off_q = (int64_t *)c.take((size_t)(B + 1) * 8), *off_kv = (int64_t *)c.take((size_t)(B + 1) * 8);
    int64_t *off_st = (int64_t *)c.take((size_t)(B + 1) * 8);
    void *ws = c.take((size_t)e->ws_bytes);
    st = check(ctx, cudaMemsetAsync(acc, 0, nacc * sizeof(float), s), "attention_bwd");
    if (!st && ragged) {
        ragged_kernel<<<1, 256, 0, s>>>(cu_seqlens, ndocs, B, Hq * D, Hkv * D, Hq, seq, off_q, off_kv, off_st);
        st = check_launch(ctx, "attention_bwd");
    } else if (!st) {
        stats_layout_kernel<<<grid_for((int64_t)nst, 256), 256, 0, s>>>(lse, stats, B, Lg, Hq, false);
        st = check_launch(ctx, "attention_bwd");
    }
    float neg_inf = -INFINITY, one = 1.0f;
    const int64_t uids[21] = {U_Q,      U_KT,     U_VT,     U_O,      U_DO,      U_STATS,   U_SCALE,
                              U_ONE,    U_NEG_INF, U_SOFTMAX_SUM, U_DQ_ACC, U_DQ, U_DK,    U_DV,
                              U_SEQ_Q,  U_SEQ_KV, U_OFF_Q,  U_OFF_KV, U_OFF_ST,  U_DK_FULL, U_DV_FULL};
    void *const ptrs[21] = {(void *)q, (void *)k, (void *)v, (void *)out, (void *)dout, stats,  &scale,
                            &one,      &neg_inf,  ssum,      acc,         dq,           dk,     dv,
                            seq,       seq,       off_q,     off_kv,      off_st,       dk_full, dv_full};
    const int n = !ragged ? 14 : full ? 21 : 19;
    if (!st && h->survey && !e->surveyed && !ragged) {
        e->surveyed = true;
        const survey_io io = {uids, ptrs, n, acc, nacc * sizeof(float), {dq, dk, dv},
                              {nacc * esz, (size_t)T * Hkv * D * esz, (size_t)T * Hkv * D * esz}};
        survey(h, e, io, s);
    }
    if (!st) st = run_plan(ctx, h, e, uids, ptrs, n, ws, s, "attention_bwd");
    loom_status sf = check(ctx, cudaFreeAsync(scratch, s), "attention_bwd (cuDNN scratch)");
    if (!st && !sf) h->calls[BWD]++, *taken = true;
    return st ? st : sf;
}
