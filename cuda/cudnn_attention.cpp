// cuDNN's fused flash attention on the backend graph API (contract in cuda/cudnn_attention.h).
//
// The graphs are the ones kiln-sdpa-probe ran on the H200 (cuDNN 9.14), where they agreed with
// kiln's kernels and the f32 composition; the probe builds them through this file, so change a
// dim, stride, id, dtype or flag here only with the probe run again. Every tensor states 16-byte
// alignment, so every pointer must have it.
#include "cuda/cudnn_attention.h"

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "core/storage.h"
#include "core/switches.h"
#include "cuda/check.h"
#include "cuda/conv.h"
#include "cuda/cudnn_util.h"
#include "cuda/runtime.h"

namespace kiln::cuda {
namespace sdpa {
namespace {

using Dims = std::vector<int64_t>;

const cudnnDataType_t kF32 = CUDNN_DATA_FLOAT;

[[noreturn]] void refused(const std::string& what, cudnnStatus_t s) {
  char buf[1024] = {0};
  cudnnGetLastErrorString(buf, sizeof buf);
  detail::fail(ErrorKind::Cudnn, __FILE__, __LINE__, nullptr,
               detail::str_cat(what, ": ", cudnnGetErrorString(s), buf[0] ? ": " : "", buf));
}

// Sets one attribute; a refusal names the node and the attribute.
void set_attr(be::Desc& d, const std::string& node, cudnnBackendAttributeName_t attr,
              const char* attr_name, cudnnBackendAttributeType_t type, int64_t count,
              const void* values) {
  const cudnnStatus_t s = cudnnBackendSetAttribute(d.get(), attr, type, count, values);
  if (s != CUDNN_STATUS_SUCCESS) refused(node + ": setting " + attr_name, s);
}
#define SDPA_SET(desc, node, attr, type, count, values) \
  set_attr(desc, node, attr, #attr, type, count, values)
#define SDPA_SET_DESC(desc, node, attr, value)                                  \
  do {                                                                          \
    cudnnBackendDescriptor_t raw_ = (value).get();                              \
    set_attr(desc, node, attr, #attr, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw_); \
  } while (0)

void finalize_desc(be::Desc& d, const std::string& what) {
  const cudnnStatus_t s = cudnnBackendFinalize(d.get());
  if (s != CUDNN_STATUS_SUCCESS) refused(what + ": finalize", s);
}

Dims dense_strides(const Dims& d) {
  Dims s(d.size(), 1);
  for (size_t i = d.size() - 1; i > 0; --i) s[i - 1] = s[i] * d[i];
  return s;
}

std::string dims_str(const Dims& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

const char* dtype_str(cudnnDataType_t t) {
  switch (t) {
    case CUDNN_DATA_HALF:
      return "f16";
    case CUDNN_DATA_BFLOAT16:
      return "bf16";
    case CUDNN_DATA_FLOAT:
      return "f32";
    default:
      return "?";
  }
}

// A (B, H, L, D) operand's transpose (B, H, D, L), by strides.
Dims t_dims(const Operand& t) { return {t.dims[0], t.dims[1], t.dims[3], t.dims[2]}; }
Dims t_strides(const Operand& t) {
  return {t.strides[0], t.strides[1], t.strides[3], t.strides[2]};
}

}  // namespace

Operand operand_of(const Tensor& t) {
  return {Dims(t.shape().begin(), t.shape().end()), Dims(t.strides().begin(), t.strides().end()),
          t.raw_data()};
}

// ---- Graph ----

const be::Desc& Graph::io(const std::string& name, int64_t uid, cudnnDataType_t dt,
                          const Dims& dims, const Dims& strides, void* data) {
  uids_.push_back(uid);
  ptrs_.push_back(data);
  return add({name, uid, dt, dims, strides, false, false});
}

const be::Desc& Graph::scalar(const std::string& name, int64_t uid, float value) {
  scalars_.push_back(std::make_unique<float>(value));
  uids_.push_back(uid);
  ptrs_.push_back(scalars_.back().get());
  by_value_uids_.push_back(uid);
  return add({name, uid, kF32, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true});
}

const be::Desc& Graph::virt(const std::string& name, cudnnDataType_t dt, const Dims& dims,
                            Dims strides) {
  if (strides.empty()) strides = dense_strides(dims);
  return add({name, next_virtual_++, dt, dims, strides, true, false});
}

void Graph::matmul(const std::string& node, const be::Desc& a, const be::Desc& b,
                   const be::Desc& c, const MatmulOverrides& ov) {
  be::Desc md(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
  SDPA_SET(md, node, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &kF32);
  finalize_desc(md, node + " (matmul descriptor)");
  be::Desc op(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_MATMUL_DESC, md);
  if (ov.m) SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, *ov.m);
  if (ov.n) SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, *ov.n);
  if (ov.k) SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, *ov.k);
  finalize_desc(op, node);
  keep(std::move(md));
  push(std::move(op), node, "matmul", c, {&a, &b});
}

void Graph::pointwise(const std::string& node, cudnnPointwiseMode_t mode, const char* mode_name,
                      const be::Desc& x, const be::Desc* b, const be::Desc& y,
                      const PointwiseOptions& opt) {
  be::Desc pd(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
  SDPA_SET(pd, node, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
  SDPA_SET(pd, node, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &opt.math);
  if (opt.axis >= 0)
    SDPA_SET(pd, node, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &opt.axis);
  finalize_desc(pd, node + " (pointwise descriptor)");
  be::Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pd);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
  if (b) SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
  if (opt.cond) SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *opt.cond);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
  const float one = 1.0f;
  SDPA_SET(op, node, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
  SDPA_SET(op, node, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
  finalize_desc(op, node);
  keep(std::move(pd));
  std::vector<const be::Desc*> in{&x};
  if (b) in.push_back(b);
  if (opt.cond) in.push_back(opt.cond);
  push(std::move(op), node, mode_name, y, in);
}

void Graph::reduce(const std::string& node, cudnnReduceTensorOp_t red, const char* red_name,
                   const be::Desc& x, const be::Desc& y) {
  be::Desc rd(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
  SDPA_SET(rd, node, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red);
  SDPA_SET(rd, node, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &kF32);
  finalize_desc(rd, node + " (reduction descriptor)");
  be::Desc op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd);
  finalize_desc(op, node);
  keep(std::move(rd));
  push(std::move(op), node, red_name, y, {&x});
}

void Graph::reshape(const std::string& node, const be::Desc& x, const be::Desc& y) {
  be::Desc op(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
  SDPA_SET_DESC(op, node, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
  finalize_desc(op, node);
  push(std::move(op), node, "reshape", y, {&x});
}

be::Desc Graph::finalize(cudnnHandle_t h) const {
  const std::string what = "operation graph";
  be::Desc g(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  std::vector<cudnnBackendDescriptor_t> raw;
  for (const be::Desc* op : ops_) raw.push_back(op->get());
  SDPA_SET(g, what, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
           int64_t(raw.size()), raw.data());
  SDPA_SET(g, what, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
  finalize_desc(g, what);
  return g;
}

std::string Graph::listing() const {
  std::string s = "   tensors (uid: name dtype dims strides):\n";
  char buf[256];
  for (const auto& [desc, t] : info_) {
    std::snprintf(buf, sizeof buf, "     %5lld: %-14s %-4s %-22s %-26s%s\n",
                  static_cast<long long>(t.uid), t.name.c_str(), dtype_str(t.dtype),
                  dims_str(t.dims).c_str(), dims_str(t.strides).c_str(),
                  t.is_virtual    ? " virtual"
                  : t.is_by_value ? " by value (host)"
                                  : "");
    s += buf;
  }
  s += "   operations, in graph order:\n";
  for (const std::string& l : lines_) s += "     " + l + "\n";
  return s;
}

bool Graph::by_value(int64_t uid) const {
  for (int64_t u : by_value_uids_)
    if (u == uid) return true;
  return false;
}

const be::Desc& Graph::add(TensorInfo info) {
  const std::string what = "tensor " + info.name;
  be::Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  SDPA_SET(t, what, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &info.dtype);
  SDPA_SET(t, what, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, int64_t(info.dims.size()),
           info.dims.data());
  SDPA_SET(t, what, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, int64_t(info.strides.size()),
           info.strides.data());
  SDPA_SET(t, what, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &info.uid);
  const int64_t alignment = 16;
  SDPA_SET(t, what, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
  const bool yes = true;
  if (info.is_virtual) SDPA_SET(t, what, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes);
  if (info.is_by_value)
    SDPA_SET(t, what, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
  finalize_desc(t, what);
  const be::Desc& d = keep(std::move(t));
  info_.emplace_back(&d, std::move(info));
  return d;
}

const be::Desc& Graph::keep(be::Desc d) {
  keep_.push_back(std::make_unique<be::Desc>(std::move(d)));
  return *keep_.back();
}

std::string Graph::label(const be::Desc& t) const {
  for (const auto& [desc, info] : info_)
    if (desc == &t) return info.name + "#" + std::to_string(info.uid);
  return "?";
}

void Graph::push(be::Desc op, const std::string& node, const char* kind, const be::Desc& out,
                 const std::vector<const be::Desc*>& in) {
  ops_.push_back(&keep(std::move(op)));
  std::string l = label(out) + " = " + kind + "(";
  for (size_t i = 0; i < in.size(); ++i) l += (i ? ", " : "") + label(*in[i]);
  lines_.push_back(l + ")   [" + node + "]");
}

// ---- the two graphs ----

namespace {

// Ids of the real tensors; virtual ones count from 100.
enum FwdUid : int64_t { kFQ = 1, kFKt, kFV, kFO, kFStats, kFScale };
enum BwdUid : int64_t {
  kBQ = 1,
  kBKt,
  kBVt,
  kBO,
  kBdO,
  kBStats,
  kBScale,
  kBOne,
  kBdQ,
  kBdK,
  kBdV,
  kBSoftmaxSum,
  kBdQAccum,
  kBSeqLenQ,
  kBSeqLenKv,
  kBNegInf
};

}  // namespace

void build_forward(Graph& g, const Problem& p, const ForwardOperands& x) {
  const cudnnDataType_t io = p.io;
  const Dims bhss{p.b, p.h, p.s, p.s}, bhs1{p.b, p.h, p.s, 1};
  const Dims stats_strides{p.h * p.s, p.s, 1, 1};
  const be::Desc& Q = g.io("Q", kFQ, io, x.q.dims, x.q.strides, x.q.data);
  // K enters transposed, (B, H, D, L), by its strides: the B operand of Q·Kᵀ.
  const be::Desc& Kt = g.io("K^T", kFKt, io, t_dims(x.k), t_strides(x.k), x.k.data);
  const be::Desc& V = g.io("V", kFV, io, x.v.dims, x.v.strides, x.v.data);
  const be::Desc& O = g.io("O", kFO, io, x.o.dims, x.o.strides, x.o.data);
  const be::Desc& Stats = g.io("stats", kFStats, kF32, bhs1, stats_strides, x.stats);
  const be::Desc& Scale = g.scalar("scale", kFScale, p.scale);

  const be::Desc& S = g.virt("S", kF32, bhss);
  g.matmul("bmm1 Q·K^T", Q, Kt, S);
  const be::Desc& Ss = g.virt("S*scale", kF32, bhss);
  g.pointwise("attn scale", CUDNN_POINTWISE_MUL, "mul", S, &Scale, Ss);
  const be::Desc& M = g.virt("row max", kF32, bhs1);
  g.reduce("softmax max", CUDNN_REDUCE_TENSOR_MAX, "reduce-max", Ss, M);
  const be::Desc& Sm = g.virt("S-max", kF32, bhss);
  g.pointwise("softmax sub", CUDNN_POINTWISE_SUB, "sub", Ss, &M, Sm);
  const be::Desc& E = g.virt("exp", kF32, bhss);
  g.pointwise("softmax exp", CUDNN_POINTWISE_EXP, "exp", Sm, nullptr, E);
  const be::Desc& Z = g.virt("row sum", kF32, bhs1);
  g.reduce("softmax sum", CUDNN_REDUCE_TENSOR_ADD, "reduce-add", E, Z);
  const be::Desc& LogZ = g.virt("log sum", kF32, bhs1);
  g.pointwise("stats log", CUDNN_POINTWISE_LOG, "log", Z, nullptr, LogZ);
  g.pointwise("stats add", CUDNN_POINTWISE_ADD, "add", M, &LogZ, Stats);
  // P in the I/O dtype: the A operand of the second matmul.
  const be::Desc& P = g.virt("P", io, bhss);
  g.pointwise("softmax div", CUDNN_POINTWISE_DIV, "div", E, &Z, P);
  g.matmul("bmm2 P·V", P, V, O);
}

void build_backward(Graph& g, const Problem& p, const BackwardOperands& x, DqForm dq,
                    cudnnDataType_t k_dtype) {
  const cudnnDataType_t io = p.io;
  const Dims bhss{p.b, p.h, p.s, p.s}, bhs1{p.b, p.h, p.s, 1}, bhsd{p.b, p.h, p.s, p.d};
  const Dims row_strides{p.h * p.s, p.s, 1, 1};
  const Dims transposed{p.h * p.s * p.s, p.s * p.s, 1, p.s};  // (B, H, Lk, Lq) of a dense S
  const be::Desc& Q = g.io("Q", kBQ, io, x.q.dims, x.q.strides, x.q.data);
  const be::Desc& Kt = g.io("K^T", kBKt, io, t_dims(x.k), t_strides(x.k), x.k.data);
  const be::Desc& Vt = g.io("V^T", kBVt, io, t_dims(x.v), t_strides(x.v), x.v.data);
  const be::Desc& O = g.io("O", kBO, io, x.o.dims, x.o.strides, x.o.data);
  const be::Desc& dO = g.io("dO", kBdO, io, x.dout.dims, x.dout.strides, x.dout.data);
  const be::Desc& Stats = g.io("stats", kBStats, kF32, bhs1, row_strides, x.stats);
  const be::Desc& Scale = g.scalar("scale", kBScale, p.scale);
  const be::Desc& One = g.scalar("one", kBOne, 1.0f);
  const be::Desc& dQ = g.io("dQ", kBdQ, io, x.dq.dims, x.dq.strides, x.dq.data);
  const be::Desc& dK = g.io("dK", kBdK, io, x.dk.dims, x.dk.strides, x.dk.data);
  const be::Desc& dV = g.io("dV", kBdV, io, x.dv.dims, x.dv.strides, x.dv.data);
  const be::Desc& Sum = g.io("softmax_sum", kBSoftmaxSum, kF32, bhs1, row_strides, x.softmax_sum);
  // The tail mask's lengths (tail_mask_needed): queries' and keys', the same memory.
  const be::Desc* Lq = nullptr;
  const be::Desc* Lk = nullptr;
  if (x.seq_lens) {
    const Dims b111{p.b, 1, 1, 1}, ones{1, 1, 1, 1};
    Lq = &g.io("seq_len_q", kBSeqLenQ, CUDNN_DATA_INT32, b111, ones, x.seq_lens);
    Lk = &g.io("seq_len_kv", kBSeqLenKv, CUDNN_DATA_INT32, b111, ones, x.seq_lens);
  }

  const be::Desc& dOO = g.virt("dO*O", kF32, bhsd);
  g.pointwise("dO*O", CUDNN_POINTWISE_MUL, "mul", dO, &O, dOO);
  const be::Desc& R = g.virt("rowsum dO*O", kF32, bhs1);
  g.reduce("rowsum dO*O", CUDNN_REDUCE_TENSOR_ADD, "reduce-add", dOO, R);
  // The dropout scale's place (1 without dropout); the result is a real tensor.
  g.pointwise("softmax_sum * 1", CUDNN_POINTWISE_MUL, "mul", R, &One, Sum);

  const be::Desc& S = g.virt("S", kF32, bhss);
  g.matmul("Q·K^T", Q, Kt, S, {.m = Lq, .n = Lk});
  const be::Desc* Ss = &g.virt("S*scale", kF32, bhss);
  g.pointwise("attn scale", CUDNN_POINTWISE_MUL, "mul", S, &Scale, *Ss);
  if (x.seq_lens) {  // S outside L × L is -inf, so P there is 0
    const cudnnDataType_t i32 = CUDNN_DATA_INT32, boolean = CUDNN_DATA_BOOLEAN;
    const be::Desc& Row = g.virt("row", i32, bhss);
    g.pointwise("row index", CUDNN_POINTWISE_GEN_INDEX, "gen-index", *Ss, nullptr, Row,
                {.math = i32, .axis = 2});
    const be::Desc& Col = g.virt("col", i32, bhss);
    g.pointwise("col index", CUDNN_POINTWISE_GEN_INDEX, "gen-index", *Ss, nullptr, Col,
                {.math = i32, .axis = 3});
    const be::Desc& RowIn = g.virt("row < L", boolean, bhss);
    g.pointwise("row < L", CUDNN_POINTWISE_CMP_LT, "lt", Row, Lq, RowIn, {.math = boolean});
    const be::Desc& ColIn = g.virt("col < L", boolean, bhss);
    g.pointwise("col < L", CUDNN_POINTWISE_CMP_LT, "lt", Col, Lk, ColIn, {.math = boolean});
    const be::Desc& In = g.virt("inside", boolean, bhss);
    g.pointwise("inside", CUDNN_POINTWISE_LOGICAL_AND, "and", RowIn, &ColIn, In,
                {.math = boolean});
    const be::Desc& NegInf =
        g.scalar("-inf", kBNegInf, -std::numeric_limits<float>::infinity());
    const be::Desc& Masked = g.virt("S masked", kF32, bhss);
    g.pointwise("tail mask", CUDNN_POINTWISE_BINARY_SELECT, "select", *Ss, &NegInf, Masked,
                {.cond = &In});
    Ss = &Masked;
  }
  const be::Desc& Sm = g.virt("S-stats", kF32, bhss);
  g.pointwise("sub stats", CUDNN_POINTWISE_SUB, "sub", *Ss, &Stats, Sm);
  const be::Desc& P = g.virt("P", kF32, bhss);
  g.pointwise("exp", CUDNN_POINTWISE_EXP, "exp", Sm, nullptr, P);
  const be::Desc& Pt = g.virt("P^T", io, {p.b, p.h, p.s, p.s}, transposed);
  g.reshape("transpose P", P, Pt);
  g.matmul("dV = P^T·dO", Pt, dO, dV, {.m = Lk, .k = Lq});

  const be::Desc& dP = g.virt("dP", kF32, bhss);
  g.matmul("dP = dO·V^T", dO, Vt, dP, {.m = Lq, .n = Lk});
  const be::Desc& D1 = g.virt("dP-sum", kF32, bhss);
  g.pointwise("sub softmax_sum", CUDNN_POINTWISE_SUB, "sub", dP, &Sum, D1);
  const be::Desc& D2 = g.virt("P*(dP-sum)", kF32, bhss);
  g.pointwise("mul P", CUDNN_POINTWISE_MUL, "mul", D1, &P, D2);
  const be::Desc& dS = g.virt("dS", kF32, bhss);
  g.pointwise("dS scale", CUDNN_POINTWISE_MUL, "mul", D2, &Scale, dS);
  const be::Desc& dSt = g.virt("dS^T", io, {p.b, p.h, p.s, p.s}, transposed);
  g.reshape("transpose dS", dS, dSt);
  g.matmul("dK = dS^T·Q", dSt, Q, dK, {.m = Lk, .k = Lq});

  const be::Desc& K = g.virt("K", k_dtype, x.k.dims, x.k.strides);
  g.reshape("transpose K^T", Kt, K);
  if (dq == DqForm::Accumulator) {
    const be::Desc& Acc = g.io("dQ_accum", kBdQAccum, kF32, bhsd, dense_strides(bhsd), x.dq_accum);
    g.matmul("dQ_accum = dS·K", dS, K, Acc, {.m = Lq, .k = Lk});
    g.pointwise("dQ = dQ_accum", CUDNN_POINTWISE_IDENTITY, "identity", Acc, nullptr, dQ);
  } else {
    g.matmul("dQ = dS·K", dS, K, dQ, {.m = Lq, .k = Lk});
  }
}

}  // namespace sdpa

// ---- kiln's attention path ----

namespace {

using sdpa::Operand;

constexpr size_t kMaxConfigs = 8;  // engine configurations whose plans are built per problem
constexpr size_t kMaxPlans = 4;    // plans timed per problem
constexpr int kTimedRuns = 3;

constinit RuntimeSwitch g_enabled{&Switches::cudnn_attention};  // KILN_CUDNN_ATTENTION

enum class Pass : int64_t { Forward = 0, Backward = 1 };

// The (B, H, L, D) operands of a problem, in the key's order.
enum Slot : int { kQ, kK, kV, kO, kDout, kDq, kDk, kDv, kSlots };
const char* const kSlotNames[kSlots] = {"q", "k", "v", "out", "dout", "dq", "dk", "dv"};

// The layouts the graphs ran with, as strides of (B, H, L, D) views.
enum class Layout : int64_t { None = 0, Bhsd, Bshd, Packed };
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::None:
      return "-";
    case Layout::Bhsd:
      return "(B, H, L, D)";
    case Layout::Bshd:
      return "(B, L, H, D)";
    case Layout::Packed:
      return "packed (B, L, 3, H, D)";
  }
  return "?";
}

// The whole problem, as plain integers: zero-initialised and without padding, so it hashes and
// compares bytewise.
struct Key {
  int64_t device = 0, pass = 0, dtype = 0, deterministic = 0;
  int64_t b = 0, h = 0, s = 0, d = 0;
  int64_t scale_bits = 0;       // the double's bits
  int64_t layout[kSlots] = {};  // a Layout per operand (None: not an operand of the pass)
  int64_t strides[kSlots][4] = {};
  bool operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }
};
using KeyHash = WordsHash<Key>;

// A problem's tuned plan, or (ok false) the record that none builds or runs.
struct Plan {
  std::mutex m;       // serialises runs
  sdpa::Graph graph;  // the descriptors the plan was made from stay alive with it
  be::Desc op_graph;
  be::Candidate chosen;
  bool ok = false;
};

// The tuner's state: one per process (keys hold the device), reached through plan_cache().
class AttentionPlanCache {
 public:
  std::mutex mutex;  // guards the map
  std::unordered_map<Key, std::shared_ptr<Plan>, KeyHash> plans;
  // The tail mask's lengths per (device, B, L): int32 [B], every entry L. Never freed, not even
  // by clear_cudnn_attention_cache(): captured graphs read them.
  std::map<std::array<int64_t, 3>, std::unique_ptr<Storage>> seq_lens;
  std::atomic<uint64_t> forward_runs{0}, backward_runs{0};
};

AttentionPlanCache& plan_cache() {
  static AttentionPlanCache cache;
  return cache;
}

std::string describe(const Key& k);

// The tail mask's lengths for a backward problem (sdpa::tail_mask_needed), made on its first
// call: outside graph capture, where its plan is tuned too.
void* seq_lens_for(const Key& key) {
  AttentionPlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  std::unique_ptr<Storage>& slot = cache.seq_lens[{key.device, key.b, key.s}];
  if (!slot) {
    KILN_CHECK(!is_capturing(), "cuDNN attention ", describe(key),
               ": the first call of a problem cannot happen during graph capture (run an eager "
               "warm-up step first, or KILN_CUDNN_ATTENTION=0)");
    const size_t bytes = size_t(key.b) * sizeof(int32_t);
    slot = std::make_unique<Storage>(bytes, Device::cuda(key.device));
    const std::vector<int32_t> lens(size_t(key.b), int32_t(key.s));
    const cudaStream_t s = current_stream();
    CUDA_CHECK(cudaMemcpyAsync(slot->data(), lens.data(), bytes, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
  }
  return slot->data();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// What both passes share: f16/bf16, q, k, v (B, H, L, D) with one L, D 64 or 128, lse (B, H, L)
// contiguous f32, and the key's common part.
bool common_problem(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                    double scale, Pass pass, sdpa::Problem& pr, Key& key) {
  if (q.dtype() != DType::f16 && q.dtype() != DType::bf16) return false;
  if (q.dim() != 4 || k.shape() != q.shape() || v.shape() != q.shape()) return false;
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype()) return false;
  if (q.size(3) != 64 && q.size(3) != 128) return false;
  if (q.numel() == 0) return false;
  const int64_t b = q.size(0), h = q.size(1), s = q.size(2);
  if (!lse.defined() || lse.dtype() != DType::f32 || lse.shape() != Shape{b, h, s} ||
      !lse.is_contiguous() || !aligned16(lse.raw_data()))
    return false;
  pr.io = q.dtype() == DType::bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  pr.b = b;
  pr.h = h;
  pr.s = s;
  pr.d = q.size(3);
  pr.scale = float(scale);
  key.device = context().device;
  key.pass = int64_t(pass);
  key.dtype = int64_t(q.dtype());
  key.deterministic = conv_deterministic();
  key.b = b;
  key.h = h;
  key.s = s;
  key.d = pr.d;
  static_assert(sizeof(double) == sizeof(int64_t));
  std::memcpy(&key.scale_bits, &scale, sizeof scale);
  return true;
}

// Puts t's layout and canonical strides into the key's `slot` and returns its operand; false
// when t is not a (B, H, L, D) view in one of the layouts, or not 16-byte aligned. The strides
// of size-1 dims never address memory; the canonical ones are what the descriptors state.
bool add_operand(Key& key, Slot slot, const Tensor& t, Operand& op) {
  const int64_t b = key.b, h = key.h, s = key.s, d = key.d;
  if (!t.defined() || t.dim() != 4 || t.shape() != Shape{b, h, s, d} ||
      t.dtype() != DType(key.dtype) || !aligned16(t.raw_data()))
    return false;
  const std::pair<Layout, std::array<int64_t, 4>> layouts[] = {
      {Layout::Bhsd, {h * s * d, s * d, d, 1}},
      {Layout::Bshd, {s * h * d, d, h * d, 1}},
      {Layout::Packed, {s * 3 * h * d, d, 3 * h * d, 1}}};
  for (const auto& [layout, strides] : layouts) {
    bool match = true;
    for (int i = 0; i < 4; ++i)
      match = match && (t.size(i) == 1 || t.stride(i) == strides[size_t(i)]);
    if (!match) continue;
    key.layout[slot] = int64_t(layout);
    for (int i = 0; i < 4; ++i) key.strides[slot][i] = strides[size_t(i)];
    op.dims = {b, h, s, d};
    op.strides.assign(strides.begin(), strides.end());
    op.data = t.raw_data();
    return true;
  }
  return false;
}

std::string describe(const Key& k) {
  double scale = 0;
  std::memcpy(&scale, &k.scale_bits, sizeof scale);
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s %s (B %lld, H %lld, L %lld, D %lld), scale %g%s",
                k.pass == int64_t(Pass::Forward) ? "forward" : "backward",
                dtype_name(DType(k.dtype)), static_cast<long long>(k.b),
                static_cast<long long>(k.h), static_cast<long long>(k.s),
                static_cast<long long>(k.d), scale, k.deterministic ? ", deterministic" : "");
  std::string s = buf;
  for (int i = 0; i < kSlots; ++i)
    if (k.layout[i] != int64_t(Layout::None))
      s += std::string(i == 0 ? "; " : ", ") + kSlotNames[i] + " " +
           layout_name(Layout(k.layout[i]));
  return s;
}

std::string cudnn_words(cudnnStatus_t s) {
  char buf[512] = {0};
  cudnnGetLastErrorString(buf, sizeof buf);
  return std::string(cudnnGetErrorString(s)) + (buf[0] ? std::string(": ") + buf : "");
}

// The variant pack's pointers for this call: each real tensor's from `io_ptr`, each by-value
// scalar the graph's own.
using IoPointer = std::function<void*(int64_t uid)>;
std::vector<void*> bound_pointers(const sdpa::Graph& g, const IoPointer& io_ptr) {
  std::vector<void*> ptrs = g.ptrs();
  for (size_t i = 0; i < ptrs.size(); ++i) {
    const int64_t uid = g.uids()[i];
    if (g.by_value(uid)) continue;
    ptrs[i] = io_ptr(uid);
    KILN_CHECK(ptrs[i] != nullptr, "cuDNN attention: no operand for tensor id ", uid);
  }
  return ptrs;
}

class Events {
 public:
  Events() {
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
  }
  ~Events() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t a = nullptr, b = nullptr;
};

// Engine configurations for the graph from heuristics modes A, B and fallback, each once, in
// that order; in deterministic mode only those cuDNN notes as deterministic. `offered` counts
// them all.
std::vector<std::pair<be::Desc, be::ConfigInfo>> configurations(const be::Desc& graph,
                                                                bool deterministic,
                                                                size_t& offered) {
  std::vector<std::pair<be::Desc, be::ConfigInfo>> out;
  std::set<std::string> seen;
  offered = 0;
  for (cudnnBackendHeurMode_t mode :
       {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_B, CUDNN_HEUR_MODE_FALLBACK})
    for (be::Desc& cfg : be::heuristic_configs(graph, mode)) {
      be::ConfigInfo info = be::describe_config(cfg);
      if (!seen.insert(info.name).second) continue;
      ++offered;
      if (deterministic && !info.deterministic) continue;
      out.emplace_back(std::move(cfg), std::move(info));
    }
  return out;
}

// Builds plan's graph with `build`, its plans, and times them on the operands `io_ptr` gives;
// keeps the fastest (plan.ok). Returns "" or why no plan runs. cuDNN's refusals are answers;
// CUDA errors propagate.
std::string tune(Plan& plan, cudnnHandle_t h, const Key& key,
                 const std::function<void(sdpa::Graph&)>& build, const IoPointer& io_ptr,
                 bool log) {
  std::vector<be::Candidate> cands;
  std::string last_failure;
  size_t offered = 0, considered = 0;
  try {
    build(plan.graph);
    plan.op_graph = plan.graph.finalize(h);
    auto cfgs = configurations(plan.op_graph, key.deterministic != 0, offered);
    considered = cfgs.size();
    if (cfgs.empty())
      return offered == 0 ? "cuDNN's heuristics offer no engine configuration for the graph"
                          : "none of the " + std::to_string(offered) +
                                " engine configurations cuDNN offers is deterministic";
    for (size_t i = 0; i < cfgs.size() && i < kMaxConfigs && cands.size() < kMaxPlans; ++i) {
      auto& [cfg, info] = cfgs[i];
      be::Desc p(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      p.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
      p.set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg);
      const cudnnStatus_t st = p.try_finalize();
      if (st != CUDNN_STATUS_SUCCESS) {
        last_failure = info.name + ": the plan does not finalise: " + cudnn_words(st);
        continue;
      }
      int64_t ws = 0, n = 0;
      const cudnnStatus_t wst = cudnnBackendGetAttribute(
          p.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws);
      if (wst != CUDNN_STATUS_SUCCESS) {
        last_failure = info.name + ": workspace size: " + cudnn_words(wst);
        continue;
      }
      be::Candidate c;
      c.config = std::move(cfg);
      c.plan = std::move(p);
      c.workspace = ws;
      c.engine = info.engine;
      c.deterministic = info.deterministic;
      c.name = info.name + (info.runtime_compiled ? " (runtime-compiled)" : "");
      cands.push_back(std::move(c));
    }
  } catch (const CudnnError& e) {
    return strip_location(e.what());
  }
  if (cands.empty())
    return "no plan finalises (" + std::to_string(considered) +
           " configurations; last: " + last_failure + ")";

  const std::vector<void*> ptrs = bound_pointers(plan.graph, io_ptr);
  const cudaStream_t s = current_stream();
  Events ev;
  int best = -1;
  for (size_t i = 0; i < cands.size(); ++i) {
    be::Candidate& c = cands[i];
    std::unique_ptr<Storage> ws;
    try {
      if (c.workspace > 0)
        ws = std::make_unique<Storage>(size_t(c.workspace), Device::cuda(key.device));
    } catch (const OutOfMemoryError&) {
      last_failure =
          c.name + ": no memory for its " + std::to_string(c.workspace) + "-byte workspace";
      continue;
    }
    void* wsp = ws ? ws->data() : nullptr;
    const cudnnStatus_t st = be::run(h, c, plan.graph.uids(), ptrs, wsp);  // warm-up, and a check
    if (st != CUDNN_STATUS_SUCCESS) {
      last_failure = c.name + ": does not run: " + cudnn_words(st);
      continue;
    }
    CUDA_CHECK(cudaEventRecord(ev.a, s));
    for (int r = 0; r < kTimedRuns; ++r) be::run(h, c, plan.graph.uids(), ptrs, wsp);
    CUDA_CHECK(cudaEventRecord(ev.b, s));
    CUDA_CHECK(cudaEventSynchronize(ev.b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, ev.a, ev.b));
    c.ms = ms / kTimedRuns;
    // Deterministic mode: the first configuration that runs, in the heuristics' order (the
    // same plan in every process); otherwise the fastest.
    if (best < 0 || (key.deterministic == 0 && c.ms < cands[size_t(best)].ms)) best = int(i);
  }
  if (log) {
    std::fprintf(stderr,
                 "[kiln attention] cuDNN %s: %zu plans of %zu configurations (%zu offered)\n",
                 describe(key).c_str(), cands.size(), considered, offered);
    for (const be::Candidate& c : cands)
      std::fprintf(stderr, "    %s: %s, workspace %lld bytes%s\n", c.name.c_str(),
                   c.ms >= 0 ? (std::to_string(c.ms) + " ms").c_str() : "did not run",
                   static_cast<long long>(c.workspace),
                   c.deterministic ? "" : ", nondeterministic");
  }
  if (best < 0) return "no plan runs (last: " + last_failure + ")";
  plan.chosen = std::move(cands[size_t(best)]);
  plan.ok = true;
  if (log)
    std::fprintf(stderr, "    chosen: %s, %.4f ms\n", plan.chosen.name.c_str(),
                 double(plan.chosen.ms));
  return "";
}

// The problem's plan: cached, or tuned now (outside graph capture only; kiln::Error during
// capture). One that no plan builds or runs for comes back with ok false (said once on stderr,
// when tuned).
std::shared_ptr<Plan> plan_for(const Key& key, cudnnHandle_t h,
                               const std::function<void(sdpa::Graph&)>& build,
                               const IoPointer& io_ptr) {
  AttentionPlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  auto it = cache.plans.find(key);
  if (it != cache.plans.end()) return it->second;
  KILN_CHECK(!is_capturing(), "cuDNN attention ", describe(key),
             ": no plan cached for this problem, and choosing one times plans on the device, "
             "which cannot happen during graph capture (run an eager warm-up step first, or "
             "KILN_CUDNN_ATTENTION=0)");
  auto plan = std::make_shared<Plan>();
  const std::string why = tune(*plan, h, key, build, io_ptr, switches().cudnn_find_log);
  if (!plan->ok)
    std::fprintf(stderr, "kiln: cuDNN attention unavailable for %s: %s; kiln's kernels run it\n",
                 describe(key).c_str(), why.c_str());
  cache.plans.emplace(key, plan);
  return plan;
}

// Runs the tuned plan on this call's operands. False (kiln's kernels run the call) when the
// problem has no plan, its workspace cannot be had, or the plan fails (said once; the problem
// goes to kiln's kernels from then on).
bool run_plan(Plan& plan, cudnnHandle_t h, const Key& key, const IoPointer& io_ptr) {
  std::lock_guard<std::mutex> lock(plan.m);
  if (!plan.ok) return false;
  std::unique_ptr<Storage> ws;
  try {
    if (plan.chosen.workspace > 0)
      ws = std::make_unique<Storage>(size_t(plan.chosen.workspace), Device::cuda(key.device));
  } catch (const OutOfMemoryError&) {
    return false;
  }
  const cudnnStatus_t st = be::run(h, plan.chosen, plan.graph.uids(),
                                   bound_pointers(plan.graph, io_ptr), ws ? ws->data() : nullptr);
  if (st == CUDNN_STATUS_SUCCESS) return true;
  std::fprintf(stderr,
               "kiln: cuDNN attention plan %s failed for %s: %s; kiln's kernels run it from now "
               "on\n",
               plan.chosen.name.c_str(), describe(key).c_str(), cudnn_words(st).c_str());
  plan.ok = false;
  return false;
}

}  // namespace

bool cudnn_attention_enabled() { return g_enabled.get(); }
void set_cudnn_attention_enabled(bool on) { g_enabled.set(on); }

bool cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, double scale, bool causal) {
  if (causal || !g_enabled.get()) return false;
  sdpa::Problem pr;
  Key key;
  if (!common_problem(q, k, v, lse, scale, Pass::Forward, pr, key)) return false;
  sdpa::ForwardOperands x;
  if (!add_operand(key, kQ, q, x.q) || !add_operand(key, kK, k, x.k) ||
      !add_operand(key, kV, v, x.v) || !add_operand(key, kO, out, x.o))
    return false;
  x.stats = lse.raw_data();
  const IoPointer io_ptr = [&x](int64_t uid) -> void* {
    switch (uid) {
      case sdpa::kFQ:
        return x.q.data;
      case sdpa::kFKt:
        return x.k.data;
      case sdpa::kFV:
        return x.v.data;
      case sdpa::kFO:
        return x.o.data;
      case sdpa::kFStats:
        return x.stats;
      default:
        return nullptr;
    }
  };
  Context& ctx = context();
  CUDNN_CHECK(cudnnSetStream(ctx.cudnn, current_stream()));
  const std::shared_ptr<Plan> plan = plan_for(
      key, ctx.cudnn, [&](sdpa::Graph& g) { sdpa::build_forward(g, pr, x); }, io_ptr);
  if (!run_plan(*plan, ctx.cudnn, key, io_ptr)) return false;
  plan_cache().forward_runs.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool cudnn_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, double scale, bool causal) {
  if (causal || !g_enabled.get()) return false;
  sdpa::Problem pr;
  Key key;
  if (!common_problem(q, k, v, lse, scale, Pass::Backward, pr, key)) return false;
  sdpa::BackwardOperands x;
  if (!add_operand(key, kQ, q, x.q) || !add_operand(key, kK, k, x.k) ||
      !add_operand(key, kV, v, x.v) || !add_operand(key, kO, out, x.o) ||
      !add_operand(key, kDout, dout, x.dout) || !add_operand(key, kDq, dq, x.dq) ||
      !add_operand(key, kDk, dk, x.dk) || !add_operand(key, kDv, dv, x.dv))
    return false;
  // Σ dO·O per row: written by the graph, read by its dS.
  const Tensor softmax_sum =
      empty({pr.b, pr.h, pr.s}, TensorOptions(DType::f32).with_device(q.device()));
  x.stats = lse.raw_data();
  x.softmax_sum = softmax_sum.raw_data();
  if (sdpa::tail_mask_needed(pr.s) && switches().cudnn_tail_mask) x.seq_lens = seq_lens_for(key);
  const IoPointer io_ptr = [&x](int64_t uid) -> void* {
    switch (uid) {
      case sdpa::kBQ:
        return x.q.data;
      case sdpa::kBKt:
        return x.k.data;
      case sdpa::kBVt:
        return x.v.data;
      case sdpa::kBO:
        return x.o.data;
      case sdpa::kBdO:
        return x.dout.data;
      case sdpa::kBStats:
        return x.stats;
      case sdpa::kBdQ:
        return x.dq.data;
      case sdpa::kBdK:
        return x.dk.data;
      case sdpa::kBdV:
        return x.dv.data;
      case sdpa::kBSoftmaxSum:
        return x.softmax_sum;
      case sdpa::kBSeqLenQ:
      case sdpa::kBSeqLenKv:
        return x.seq_lens;
      default:
        return nullptr;  // no accumulator: the direct dQ form
    }
  };
  Context& ctx = context();
  CUDNN_CHECK(cudnnSetStream(ctx.cudnn, current_stream()));
  const std::shared_ptr<Plan> plan = plan_for(
      key, ctx.cudnn, [&](sdpa::Graph& g) { sdpa::build_backward(g, pr, x, sdpa::DqForm::Direct); },
      io_ptr);
  if (!run_plan(*plan, ctx.cudnn, key, io_ptr)) return false;
  plan_cache().backward_runs.fetch_add(1, std::memory_order_relaxed);
  return true;
}

CudnnAttentionStats cudnn_attention_stats() {
  AttentionPlanCache& cache = plan_cache();
  CudnnAttentionStats st;
  st.forward_runs = cache.forward_runs.load();
  st.backward_runs = cache.backward_runs.load();
  std::lock_guard<std::mutex> lock(cache.mutex);
  for (const auto& [key, plan] : cache.plans) {
    std::lock_guard<std::mutex> plan_lock(plan->m);  // run_plan may drop a failing plan
    (plan->ok ? st.plans : st.unavailable) += 1;
  }
  return st;
}

void clear_cudnn_attention_cache() {
  AttentionPlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.plans.clear();
  cache.forward_runs = 0;
  cache.backward_runs = 0;
}

}  // namespace kiln::cuda
