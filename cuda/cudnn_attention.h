#pragma once
// cuDNN's fused flash attention (SDPA) through the backend graph API (cuda/cudnn_graph.h): the
// operation graphs, and kiln's attention path on them. Internal to cuda/ (and kiln-sdpa-probe,
// which builds the same graphs to list cuDNN's engines and time them).
//
// The graphs are the composite pattern cuDNN's SDPA engines match (the one cudnn-frontend lowers
// its sdpa nodes to), on (B, H, L, D) views with any strides the descriptors can state; no mask,
// no dropout, one length L for queries and keys:
//   forward:  S = Q·Kᵀ (f32), S·scale, the softmax as reduce-max / sub / exp / reduce-add / div
//             with P in the I/O dtype, O = P·V; stats = max + log Σ exp (f32 [B, H, L, 1]) is
//             each row's log-sum-exp, the `lse` kiln's own kernels write and read.
//   backward: softmax_sum = rowsum(dO∘O) (f32 [B, H, L, 1], written); P = exp(scale·Q·Kᵀ - stats);
//             dV = Pᵀ·dO; dP = dO·Vᵀ; dS = scale·P∘(dP - softmax_sum); dK = dSᵀ·Q; dQ = dS·K,
//             written directly (deterministic) or, in the probe only, through an f32 accumulator;
//             where L is not a multiple of 128, scale·Q·Kᵀ outside L × L is masked to -inf and
//             the matmuls are told the real lengths (tail_mask_needed says why).
// Ran on an H200 with cuDNN 9.14 at ViT-B/16's shape (batch 128, 12 heads, L 197, D 64): forward
// 0.091 ms against kiln's kernel's 0.234, backward (direct dQ) 0.340 against 0.618.
#include <cudnn.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "cuda/cudnn_graph.h"

namespace kiln::cuda {

// ---- kiln's attention path (AttentionPaths' contracts, core/backend.h) ----
//
// cuda/backend.cpp's table calls these first; false means "not run": the caller runs kiln's own
// kernels (cuda/kernels.h), which overwrite every output (a false return may follow tuning runs
// that wrote into them). They return false when
//  - the path is off: KILN_CUDNN_ATTENTION=0 or set_cudnn_attention_enabled(false);
//  - causal, Lq != Lk, a dtype other than f16/bf16, a head dim other than 64 or 128, lse not
//    contiguous f32, a pointer not 16-byte aligned;
//  - a (B, H, L, D) operand's strides are not one of the layouts the graphs were run with:
//    contiguous (B, H, L, D); (B, L, H, D) memory seen as (B, H, L, D); one part of a packed
//    (B, L, 3, H, D) tensor (strides of size-1 dims do not matter);
//  - no plan builds or runs for the problem (stderr says so once per problem: "kiln: cuDNN
//    attention unavailable for ...").
// The first call of a problem (device, pass, dtype, B, H, L, D, every operand's strides, scale,
// conv_deterministic()) builds its graph, asks cuDNN's heuristics (modes A, B, fallback), builds
// up to 4 plans from the first 8 configurations (only deterministic ones in deterministic mode)
// and times them on the call's own operands; the fastest is cached, as is a failure. That call
// synchronises the host and must not run during graph capture (kiln::Error then, as for a
// convolution: run an eager warm-up step first); later calls only launch. Stream:
// current_stream(); workspace and the backward's softmax_sum from the caching allocator.
// KILN_CUDNN_FIND_LOG=1 prints each problem's plans and the choice.
bool cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, double scale, bool causal);
// dq, dk, dv (=) from dout, the forward's out and lse (cuDNN's or kiln's: the same lse). dQ is
// written directly, no float atomics: bit-reproducible, and a captured graph replays it equal
// to eager.
bool cudnn_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, double scale, bool causal);

// On unless KILN_CUDNN_ATTENTION=0 or switched off here (tests compare both ways).
bool cudnn_attention_enabled();
void set_cudnn_attention_enabled(bool on);

struct CudnnAttentionStats {
  uint64_t forward_runs = 0;   // forward calls cuDNN ran
  uint64_t backward_runs = 0;  // backward calls cuDNN ran
  size_t plans = 0;            // problems with a tuned plan
  size_t unavailable = 0;      // problems no plan builds or runs for
};
CudnnAttentionStats cudnn_attention_stats();
// Forgets every cached plan and zeroes the counters (tests).
void clear_cudnn_attention_cache();

// ---- the graphs (what the path above builds; kiln-sdpa-probe builds them too) ----
namespace sdpa {

// One (B, H, L, D) operand: dims, strides in elements, and its memory.
struct Operand {
  std::vector<int64_t> dims, strides;
  void* data = nullptr;
};
Operand operand_of(const Tensor& t);

struct Problem {
  cudnnDataType_t io = CUDNN_DATA_HALF;  // Q, K, V, O, dO, dQ, dK, dV
  int64_t b = 0, h = 0, s = 0, d = 0;
  float scale = 0;
};

struct ForwardOperands {
  Operand q, k, v, o;
  void* stats = nullptr;  // f32 (B, H, L) contiguous
};

struct BackwardOperands {
  Operand q, k, v, o, dout, dq, dk, dv;
  void* stats = nullptr;        // the forward's, f32 (B, H, L) contiguous
  void* softmax_sum = nullptr;  // f32 (B, H, L) contiguous, written
  void* dq_accum = nullptr;     // f32 (B, H, L, D) contiguous, zeroed: DqForm::Accumulator only
  // int32 [B], every entry L, or null. Non-null: the graph masks the scores outside L × L to
  // -inf and tells each matmul its real lengths, the tail mask the backward needs where L is not
  // a multiple of 128 (see tail_mask_needed).
  void* seq_lens = nullptr;
};

// Whether the backward at length L needs the tail mask. cuDNN's Hopper backward engines (9.14
// here) score the padded part of the last 128-wide key tile as 0, not -inf: P there is
// exp(-stats), and where a row's statistics are very negative, dS overflows and 0·inf puts NaN
// into dQ (dK and dV stay finite). cudnn-frontend adds the same mask for these lengths up to
// cuDNN 9.15. Without it kiln's vit_s_16 and vit_b_16 steps (L 197) got NaN in dQ from finite
// inputs, and the loss scaler skipped a third of the steps; the mask costs ~1.6 ms of vit_b_16's
// 36 ms step (docs/lab/transformer.md). KILN_CUDNN_TAIL_MASK=0 leaves it out, to measure newer
// cuDNNs.
inline bool tail_mask_needed(int64_t l) { return l % 128 != 0; }

enum class DqForm {
  Direct,       // dQ = dS·K into dQ: the deterministic engines
  Accumulator,  // dQ_accum = dS·K (f32, +=), dQ = dQ_accum: the non-deterministic engines
};

// A matmul's real sizes where its dims are padded: each non-null one is an int32 [B, 1, 1, 1]
// tensor of every batch entry's M, N or K.
struct MatmulOverrides {
  const be::Desc* m = nullptr;
  const be::Desc* n = nullptr;
  const be::Desc* k = nullptr;
};

// A pointwise operation's settings beyond mode and operands. `math`: the compute type (int32
// for GEN_INDEX, boolean for comparisons and logic); `axis`: GEN_INDEX's dim; `cond`:
// BINARY_SELECT's condition (y = cond ? x : b).
struct PointwiseOptions {
  cudnnDataType_t math = CUDNN_DATA_FLOAT;
  int64_t axis = -1;
  const be::Desc* cond = nullptr;
};

// An operation graph under construction: its tensor and operation descriptors, the memory bound
// to each real tensor (the variant pack's ids and pointers), and a listing of both. A setter or
// finalize that cuDNN refuses throws kiln::CudnnError naming the node and the attribute.
class Graph {
 public:
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // A tensor in device memory at `data`.
  const be::Desc& io(const std::string& name, int64_t uid, cudnnDataType_t dt,
                     const std::vector<int64_t>& dims, const std::vector<int64_t>& strides,
                     void* data);
  // An f32 scalar passed by value (a host pointer in the variant pack), [1, 1, 1, 1].
  const be::Desc& scalar(const std::string& name, int64_t uid, float value);
  // A tensor that lives only inside the fused kernel; dense strides unless given. Its id counts
  // from 100 in creation order.
  const be::Desc& virt(const std::string& name, cudnnDataType_t dt,
                       const std::vector<int64_t>& dims, std::vector<int64_t> strides = {});

  // c = a·b over the last two dims, f32 compute; see MatmulOverrides.
  void matmul(const std::string& node, const be::Desc& a, const be::Desc& b, const be::Desc& c,
              const MatmulOverrides& ov = {});
  // y = mode(x [, b]); b (may be null) broadcasts; see PointwiseOptions.
  void pointwise(const std::string& node, cudnnPointwiseMode_t mode, const char* mode_name,
                 const be::Desc& x, const be::Desc* b, const be::Desc& y,
                 const PointwiseOptions& opt = {});
  // y = reduce(x) over the dims where y has size 1, f32 compute.
  void reduce(const std::string& node, cudnnReduceTensorOp_t red, const char* red_name,
              const be::Desc& x, const be::Desc& y);
  // y = x seen with y's dims and strides (a transpose when the strides say so).
  void reshape(const std::string& node, const be::Desc& x, const be::Desc& y);

  // The finalised operation graph of every operation so far, on `h`.
  be::Desc finalize(cudnnHandle_t h) const;

  // Every tensor (uid, name, dtype, dims, strides, virtual / by value) and every operation in
  // graph order, as indented lines.
  std::string listing() const;
  size_t op_count() const { return ops_.size(); }
  // The variant pack: ids and pointers of the real tensors (scalars: host pointers).
  const std::vector<int64_t>& uids() const { return uids_; }
  const std::vector<void*>& ptrs() const { return ptrs_; }
  // Whether the real tensor `uid` is a by-value scalar (its pointer is the graph's own).
  bool by_value(int64_t uid) const;

 private:
  struct TensorInfo {
    std::string name;
    int64_t uid = 0;
    cudnnDataType_t dtype = CUDNN_DATA_FLOAT;
    std::vector<int64_t> dims, strides;
    bool is_virtual = false, is_by_value = false;
  };
  const be::Desc& add(TensorInfo info);
  const be::Desc& keep(be::Desc d);
  std::string label(const be::Desc& t) const;
  void push(be::Desc op, const std::string& node, const char* kind, const be::Desc& out,
            const std::vector<const be::Desc*>& in);

  std::vector<std::unique_ptr<be::Desc>> keep_;
  std::vector<const be::Desc*> ops_;
  std::vector<std::pair<const be::Desc*, TensorInfo>> info_;  // creation order
  std::vector<std::string> lines_;
  std::vector<std::unique_ptr<float>> scalars_;
  std::vector<int64_t> uids_, by_value_uids_;
  std::vector<void*> ptrs_;
  int64_t next_virtual_ = 100;
};

// The training forward: O and the rows' statistics.
void build_forward(Graph& g, const Problem& p, const ForwardOperands& x);
// dQ, dK, dV from Q, K, V, O, dO and the statistics. k_dtype: the dtype of the virtual K that
// dQ = dS·K reads, reshaped from Kᵀ (f32; the probe also tries the I/O dtype).
void build_backward(Graph& g, const Problem& p, const BackwardOperands& x, DqForm dq,
                    cudnnDataType_t k_dtype = CUDNN_DATA_FLOAT);

}  // namespace sdpa
}  // namespace kiln::cuda
