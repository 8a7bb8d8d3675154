// Synchronised batch norm: batch statistics over the global batch of all data-parallel ranks.
//
// Forward: local per-channel [Σx, Σx², count] (one pass over x), ONE all-reduce, then mean and
// biased variance of the global batch normalise x (a second pass). Backward: local [Σdy, Σdy·x̂]
// (one pass), ONE all-reduce, then dx (a second pass). The packed vectors are the statistics
// dtype (f32 on CUDA, also for f16/bf16 x), so the reductions stay in f32 whatever the data.
//
// The variance comes from Σx² - n·mean², which loses digits when |mean| >> std (as a one-pass
// kernel would); PyTorch instead all-gathers per-rank (mean, invstd, count), which a sum-only
// reducer cannot express. f32 sums are accurate enough for activations with |mean| ~ std.
//
// Gradients and data parallelism. Let rank q's loss be L_q and L = Σ_q L_q. Backwards from the
// losses, every gradient rank r computes is ∂L/∂(its tensor): per-sample ops (conv, ReLU, pool,
// linear) only feed the rank's own later tensors, and here dx_r = w·invstd·(dy_r - mean_g(dy) -
// x̂_r·mean_g(dy·x̂)), with means over the global batch, is rank r's slice of full-batch batch
// norm's dx for the upstream gradients (dy_1, ..., dy_R) of all ranks. The parameter gradients
// of the ranks (dweight_r = Σ_local dy·x̂ and dbias_r = Σ_local dy here) thus sum to ∂L/∂θ.
// kiln-train's loss is each rank's mean over its n = N/R samples (equal shards: drop_last), so
// the big batch's loss L_big = (1/N) Σ_all ℓ = L/R, and GradBucketer's average over ranks,
// (1/R)·∂L/∂θ, is exactly ∂L_big/∂θ, for BN's parameters and the convolutions' alike (each
// rank's dx is R times the big batch's). tests/test_sync_batch_norm.cpp checks both cases.
#include <algorithm>

#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

constexpr const char* kOp = "sync_batch_norm";

// f32 on CUDA (the kernels accumulate in f32 for every data dtype), x's dtype on the CPU.
DType stat_dtype(const Tensor& x) { return x.is_cuda() ? DType::f32 : x.dtype(); }

void validate(const Tensor& x, const std::vector<Tensor>& params, const StatsAllReduce& reduce) {
  static const char* kNames[] = {"weight", "bias", "running_mean", "running_var"};
  check_defined(x, kOp, "x");
  check_float(x, kOp);
  KILN_CHECK(reduce, "sync_batch_norm: the statistics all-reduce is empty");
  KILN_CHECK(x.dim() >= 2, "sync_batch_norm: x must be (N, C, ...), got ", x.desc());
  const int64_t c = x.size(1);
  KILN_CHECK(x.numel() / std::max<int64_t>(c, 1) > 1, "sync_batch_norm: training needs more than "
             "one value per channel on each rank, got x ", x.desc());
  if (x.is_cpu())
    KILN_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::f64, "sync_batch_norm: on the CPU "
               "x must be f32 or f64, got ", x.desc());
  else
    KILN_CHECK(x.dtype() != DType::f64, "sync_batch_norm: on CUDA x must be f32, f16 or bf16, "
               "got ", x.desc());
  const DType pd = stat_dtype(x);
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    if (!p.defined()) continue;
    KILN_CHECK(p.dim() == 1 && p.size(0) == c, "sync_batch_norm: ", kNames[i], " must be (", c,
               ") for x ", x.desc(), ", got ", p.desc());
    KILN_CHECK(p.dtype() == pd, "sync_batch_norm: ", kNames[i], " must be ", dtype_name(pd),
               " for x ", x.desc(), " (", x.is_cpu() ? "x's dtype on the CPU" : "f32 on CUDA",
               "), got ", p.desc());
    KILN_CHECK(p.device() == x.device(), "sync_batch_norm: device mismatch: x ", x.desc(), " vs ",
               kNames[i], " ", p.desc());
  }
  const Tensor &rm = params[2], &rv = params[3];
  KILN_CHECK(rm.defined() == rv.defined(), "sync_batch_norm: running_mean and running_var must "
             "be given together (got ", rm.desc(), " and ", rv.desc(), ")");
  if (rm.defined()) {
    if (x.is_cuda())  // updated in place by the kernel
      KILN_CHECK(rm.is_contiguous() && rv.is_contiguous(), "sync_batch_norm: on CUDA the "
                 "running statistics must be contiguous, got ", rm.desc(), " and ", rv.desc());
    autograd::check_inplace(rm, "sync_batch_norm (running_mean update)");
    autograd::check_inplace(rv, "sync_batch_norm (running_var update)");
  }
}

// A (C) parameter as the kernels take it: detached, contiguous on CUDA; undefined stays so.
Tensor param(const Tensor& p) {
  if (!p.defined()) return Tensor();
  return p.is_cuda() ? p.detach().contiguous() : p.detach();
}

class SyncBatchNormBackward final : public Node {
 public:
  SyncBatchNormBackward(const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& invstd, const Tensor& count, StatsAllReduce reduce,
                        MemoryFormat fmt)
      : x_(x), weight_(weight), mean_(mean), invstd_(invstd), count_(count),
        reduce_(std::move(reduce)), fmt_(fmt) {}
  std::string name() const override { return "SyncBatchNormBackward"; }
  void release_saved() override {
    for (SavedTensor* s : {&x_, &weight_, &mean_, &invstd_, &count_}) s->release();
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    Tensor x = x_.get(*this), mean = mean_.get(*this), invstd = invstd_.get(*this);
    Tensor w = weight_.defined() ? weight_.get(*this) : Tensor();
    // An undefined dy is zero here but not on the other ranks: this rank still takes part in
    // the reduction, and its dx (from the others' dy) is not zero.
    Tensor dy = grads[0].defined() ? grads[0].to(x.dtype()).contiguous(fmt_) : zeros_like(x);
    const int64_t c = x.size(1);
    Tensor sums = empty({2 * c}, TensorOptions(mean.dtype()).with_device(x.device()));
    backend(x).sync_batch_norm_backward_sums(sums, dy, x, mean, invstd);
    // This rank's parts of dbias and dweight, taken before the reduction overwrites sums.
    Tensor db = needs_input_grad(2) ? sums.narrow(0, 0, c).clone() : Tensor();
    Tensor dw = needs_input_grad(1) ? sums.narrow(0, c, c).clone() : Tensor();
    Tensor dx;
    if (needs_input_grad(0)) {
      reduce_(sums);
      Tensor count = count_.get(*this);
      dx = empty(x.shape(),
                 TensorOptions(x.dtype()).with_device(x.device()).with_memory_format(fmt_));
      backend(x).sync_batch_norm_backward_dx(dx, dy, x, w, mean, invstd, sums, count);
    }
    return {dx, dw, db};
  }

 private:
  SavedTensor x_, weight_, mean_, invstd_, count_;
  StatsAllReduce reduce_;
  MemoryFormat fmt_;
};

}  // namespace

Tensor sync_batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const Tensor& running_mean, const Tensor& running_var, double momentum,
                       double eps, const StatsAllReduce& all_reduce) {
  KILN_OP_SCOPE("sync_batch_norm", x);
  validate(x, {weight, bias, running_mean, running_var}, all_reduce);
  const MemoryFormat fmt = x.suggest_memory_format();
  const Tensor xc = x.detach().contiguous(fmt);
  const Tensor w = param(weight), b = param(bias);
  const int64_t c = x.size(1);
  const auto sopts = TensorOptions(stat_dtype(x)).with_device(x.device());

  Tensor stats = empty({2 * c + 1}, sopts);  // [Σx (C), Σx² (C), count]
  backend(x).sync_batch_norm_stats(stats, xc);
  all_reduce(stats);

  Tensor y = empty(x.shape(),
                   TensorOptions(x.dtype()).with_device(x.device()).with_memory_format(fmt));
  Tensor save_mean = empty({c}, sopts), save_invstd = empty({c}, sopts);
  if (running_mean.defined()) {
    running_mean.bump_version();
    running_var.bump_version();
  }
  backend(x).sync_batch_norm_apply(y, save_mean, save_invstd, xc, w, b, running_mean,
                                   running_var, stats, momentum, eps);
  if (autograd::any_requires_grad({x, weight, bias})) {
    auto node = std::make_shared<SyncBatchNormBackward>(
        xc, w, save_mean, save_invstd, stats.narrow(0, 2 * c, 1), all_reduce, fmt);
    node->set_inputs({x, weight, bias});
    autograd::set_history(y, node);
  }
  return y;
}

}  // namespace kiln::F
