// Batch norm on cuDNN (entry points in cuda/kernels.h), plain and fused with ReLU / add + ReLU.
//
// Layout: 4-D inputs run in their own layout (NHWC or NCHW); (N, C) and (N, C, L) inputs are
// viewed as (N, C, 1, 1) and (N, C, L, 1). NHWC f16 uses CUDNN_BATCHNORM_SPATIAL_PERSISTENT
// (the fast single-pass kernels); everything else CUDNN_BATCHNORM_SPATIAL. Parameters and
// statistics are f32 (the descriptor cudnnDeriveBNTensorDescriptor gives for f32/f16 data).
//
// cuDNN's conventions match the contract in cuda/kernels.h: resultSaveInvVariance holds
// 1/sqrt(var_biased + eps), the running variance is updated with the unbiased batch variance,
// and exponentialAverageFactor plays the role of momentum (r = (1-f)·r + f·stat).
//
// The plain ops use the *Ex functions, which may ask for a reserve space; the plain backward has
// no way to receive one, so when cuDNN asks for it (the same query answers identically in
// forward and backward) the plain non-Ex functions are used instead.
//
// Backward: cuDNN wants the forward's epsilon, but with the saved mean and inverse std passed
// it does not recompute them; the plain backward's contract has no eps, so kDefaultEps stands in.
#include <memory>

#include "cuda/cudnn_util.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"

namespace kiln::cuda {
namespace {

constexpr double kDefaultEps = 1e-5;
const float kOne = 1.0f, kZero = 0.0f;

enum class BnOps { Norm, Relu, AddRelu };
cudnnBatchNormOps_t cudnn_ops(BnOps o) {
  switch (o) {
    case BnOps::Norm: return CUDNN_BATCHNORM_OPS_BN;
    case BnOps::Relu: return CUDNN_BATCHNORM_OPS_BN_ACTIVATION;
    case BnOps::AddRelu: return CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION;
  }
  return CUDNN_BATCHNORM_OPS_BN;
}

// How one input runs: its layout, its 4-D shape for the descriptors, the cuDNN mode.
struct Layout {
  MemoryFormat fmt = MemoryFormat::Contiguous;
  Shape shape4;
  cudnnBatchNormMode_t mode = CUDNN_BATCHNORM_SPATIAL;
};
Layout layout_for(const Tensor& x) {
  KILN_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::f16 || x.dtype() == DType::bf16,
             "batch_norm (cuda): dtype must be f32, f16 or bf16, got ", x.desc());
  KILN_CHECK(x.dim() >= 2 && x.dim() <= 4, "batch_norm (cuda): input must be 2-D to 4-D, got ",
             x.desc());
  Layout l;
  if (x.dim() == 4) {
    l.fmt = x.suggest_memory_format();
    l.shape4 = x.shape();
  } else {
    l.shape4 = {x.size(0), x.size(1), x.dim() == 3 ? x.size(2) : 1, 1};
  }
  if (l.fmt == MemoryFormat::ChannelsLast && x.dtype() == DType::f16)
    l.mode = CUDNN_BATCHNORM_SPATIAL_PERSISTENT;
  return l;
}

// The descriptors of one call: data tensors (x, y, dy, dx, z all share one layout) and params.
struct Descs {
  TensorDesc data;
  TensorDesc param;
  Descs(DType t, const Layout& l) : data(t, l.shape4, format_strides(l.shape4, l.fmt)) {
    CUDNN_CHECK(cudnnDeriveBNTensorDescriptor(param.d, data.d, l.mode));
  }
};

// f32 (C) parameter: t when defined (dense), else filled with `fill`.
Tensor param_or(const Tensor& t, double fill, int64_t c, Device dev) {
  if (t.defined()) return dense_in(t, MemoryFormat::Contiguous);
  return full({c}, fill, TensorOptions(DType::f32).with_device(dev));
}
// f32 (C) output buffer: t's (via a temporary when not dense), or a scratch one when undefined.
Tensor param_out(const Tensor& t, int64_t c, Device dev) {
  if (t.defined()) return out_buffer(t, MemoryFormat::Contiguous);
  return empty({c}, TensorOptions(DType::f32).with_device(dev));
}
void finish_param(const Tensor& t, const Tensor& buf) {
  if (t.defined()) finish_out(t, buf);
}
void* ptr_or_null(const Tensor& t) { return t.defined() ? t.raw_data() : nullptr; }

cudnnHandle_t handle() {
  Context& ctx = context();
  CUDNN_CHECK(cudnnSetStream(ctx.cudnn, current_stream()));
  return ctx.cudnn;
}

std::unique_ptr<Storage> scratch(size_t bytes, Device dev) {
  if (bytes == 0) return nullptr;
  return std::make_unique<Storage>(bytes, dev);
}

void check_fused(const char* op, const Tensor& x) {
  KILN_CHECK(x.dim() == 4 && x.dtype() == DType::f16 && x.is_contiguous(MemoryFormat::ChannelsLast),
             op, ": cuDNN's fused batch norm needs a 4-D f16 channels-last (NHWC) input, got ",
             x.desc());
}

// Forward training for all three op kinds; returns the reserve space (u8).
Tensor forward_training(BnOps ops, const Tensor& y, const Tensor& save_mean,
                        const Tensor& save_invstd, const Tensor& x, const Tensor& z,
                        const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                        const Tensor& running_var, double momentum, double eps) {
  const Layout l = layout_for(x);
  const int64_t c = x.size(1);
  const Device dev = x.device();
  KILN_CHECK(running_mean.defined() == running_var.defined(),
             "batch_norm (cuda): running_mean and running_var must be both defined or both not");
  if (running_mean.defined()) {
    KILN_CHECK(running_mean.is_contiguous() && running_var.is_contiguous() &&
                   running_mean.dtype() == DType::f32 && running_var.dtype() == DType::f32,
               "batch_norm (cuda): running stats must be dense f32, got ", running_mean.desc(),
               " and ", running_var.desc());
  }
  cudnnHandle_t h = handle();
  Descs d(x.dtype(), l);
  Tensor xc = dense_in(x, l.fmt);
  Tensor zc = z.defined() ? dense_in(z, l.fmt) : Tensor();
  Tensor yb = out_buffer(y, l.fmt);
  Tensor w = param_or(weight, 1.0, c, dev), b = param_or(bias, 0.0, c, dev);
  Tensor sm = param_out(save_mean, c, dev), si = param_out(save_invstd, c, dev);
  const cudnnBatchNormOps_t cops = cudnn_ops(ops);
  std::unique_ptr<ActivationDesc> act;
  if (ops != BnOps::Norm) act = std::make_unique<ActivationDesc>(CUDNN_ACTIVATION_RELU);
  cudnnActivationDescriptor_t ad = act ? act->d : nullptr;
  cudnnTensorDescriptor_t zd = zc.defined() ? d.data.d : nullptr;

  size_t reserve_bytes = 0;
  CUDNN_CHECK(cudnnGetBatchNormalizationTrainingExReserveSpaceSize(h, l.mode, cops, ad, d.data.d,
                                                                   &reserve_bytes));
  Tensor reserve = empty({int64_t(reserve_bytes)}, TensorOptions(DType::u8).with_device(dev));
  if (ops == BnOps::Norm && reserve_bytes > 0) {
    CUDNN_CHECK(cudnnBatchNormalizationForwardTraining(
        h, l.mode, &kOne, &kZero, d.data.d, xc.raw_data(), d.data.d, yb.raw_data(), d.param.d,
        w.raw_data(), b.raw_data(), momentum, ptr_or_null(running_mean),
        ptr_or_null(running_var), eps, sm.raw_data(), si.raw_data()));
  } else {
    size_t ws_bytes = 0;
    CUDNN_CHECK(cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
        h, l.mode, cops, d.data.d, zd, d.data.d, d.param.d, ad, &ws_bytes));
    auto ws = scratch(ws_bytes, dev);
    CUDNN_CHECK(cudnnBatchNormalizationForwardTrainingEx(
        h, l.mode, cops, &kOne, &kZero, d.data.d, xc.raw_data(), zd, ptr_or_null(zc), d.data.d,
        yb.raw_data(), d.param.d, w.raw_data(), b.raw_data(), momentum,
        ptr_or_null(running_mean), ptr_or_null(running_var), eps, sm.raw_data(), si.raw_data(),
        ad, ws ? ws->data() : nullptr, ws_bytes, reserve_bytes ? reserve.raw_data() : nullptr,
        reserve_bytes));
  }
  if (running_mean.defined()) {
    running_mean.bump_version();
    running_var.bump_version();
  }
  finish_out(y, yb);
  finish_param(save_mean, sm);
  finish_param(save_invstd, si);
  return reserve;
}

// Backward for all three op kinds (y, bias, reserve and dz only matter for the fused ones).
// accumulate_params: dweight and dbias += (cuDNN's betaParamDiff = 1), written in place.
void backward(BnOps ops, const Tensor& dx, const Tensor& dz, const Tensor& dweight,
              const Tensor& dbias, const Tensor& dy, const Tensor& x, const Tensor& y,
              const Tensor& weight, const Tensor& bias, const Tensor& save_mean,
              const Tensor& save_invstd, const Tensor& reserve, double eps,
              bool accumulate_params) {
  const Layout l = layout_for(x);
  const int64_t c = x.size(1);
  const Device dev = x.device();
  cudnnHandle_t h = handle();
  Descs d(x.dtype(), l);
  Tensor xc = dense_in(x, l.fmt), dyc = dense_in(dy, l.fmt);
  Tensor yc = y.defined() ? dense_in(y, l.fmt) : Tensor();
  Tensor dxb = out_buffer(dx, l.fmt);
  Tensor dzb = dz.defined() ? out_buffer(dz, l.fmt) : Tensor();
  Tensor w = param_or(weight, 1.0, c, dev), b = param_or(bias, 0.0, c, dev);
  Tensor dw = param_out(dweight, c, dev), db = param_out(dbias, c, dev);
  if (accumulate_params) {
    // cuDNN adds onto what is there: the outputs themselves, dense; an unwanted one a zeroed
    // scratch (cuDNN always writes both).
    for (auto [t, buf] : {std::pair{&dweight, &dw}, {&dbias, &db}}) {
      if (!t->defined())
        *buf = zeros({c}, TensorOptions(DType::f32).with_device(dev));
      else
        KILN_CHECK(buf->is_same(*t), "batch_norm (cuda) backward: accumulating parameter "
                   "gradients must be dense f32 (", c, "), got ", t->desc());
    }
  }
  const float* beta_param = accumulate_params ? &kOne : &kZero;
  Tensor sm = dense_in(save_mean, MemoryFormat::Contiguous);
  Tensor si = dense_in(save_invstd, MemoryFormat::Contiguous);
  const cudnnBatchNormOps_t cops = cudnn_ops(ops);
  std::unique_ptr<ActivationDesc> act;
  if (ops != BnOps::Norm) act = std::make_unique<ActivationDesc>(CUDNN_ACTIVATION_RELU);
  cudnnActivationDescriptor_t ad = act ? act->d : nullptr;
  cudnnTensorDescriptor_t yd = yc.defined() ? d.data.d : nullptr;
  cudnnTensorDescriptor_t dzd = dzb.defined() ? d.data.d : nullptr;

  size_t reserve_bytes = 0;
  CUDNN_CHECK(cudnnGetBatchNormalizationTrainingExReserveSpaceSize(h, l.mode, cops, ad, d.data.d,
                                                                   &reserve_bytes));
  if (ops == BnOps::Norm && reserve_bytes > 0) {
    CUDNN_CHECK(cudnnBatchNormalizationBackward(
        h, l.mode, &kOne, &kZero, &kOne, beta_param, d.data.d, xc.raw_data(), d.data.d,
        dyc.raw_data(), d.data.d, dxb.raw_data(), d.param.d, w.raw_data(), dw.raw_data(),
        db.raw_data(), eps, sm.raw_data(), si.raw_data()));
  } else {
    if (ops != BnOps::Norm) {
      KILN_CHECK(reserve.defined() && size_t(reserve.nbytes()) >= reserve_bytes,
                 "batch_norm (cuda) fused backward: reserve space of ", reserve_bytes,
                 " bytes expected, got ", reserve.defined() ? reserve.desc() : "undefined");
    }
    size_t ws_bytes = 0;
    CUDNN_CHECK(cudnnGetBatchNormalizationBackwardExWorkspaceSize(
        h, l.mode, cops, d.data.d, yd, d.data.d, dzd, d.data.d, d.param.d, ad, &ws_bytes));
    auto ws = scratch(ws_bytes, dev);
    CUDNN_CHECK(cudnnBatchNormalizationBackwardEx(
        h, l.mode, cops, &kOne, &kZero, &kOne, beta_param, d.data.d, xc.raw_data(), yd,
        ptr_or_null(yc), d.data.d, dyc.raw_data(), dzd, ptr_or_null(dzb), d.data.d,
        dxb.raw_data(), d.param.d, w.raw_data(), b.raw_data(), dw.raw_data(), db.raw_data(), eps,
        sm.raw_data(), si.raw_data(), ad, ws ? ws->data() : nullptr, ws_bytes,
        reserve_bytes ? reserve.raw_data() : nullptr, reserve_bytes));
  }
  finish_out(dx, dxb);
  if (dz.defined()) finish_out(dz, dzb);
  finish_param(dweight, dw);
  finish_param(dbias, db);
}

}  // namespace

void batch_norm_forward_training(const Tensor& y, const Tensor& save_mean,
                                 const Tensor& save_invstd, const Tensor& x, const Tensor& weight,
                                 const Tensor& bias, const Tensor& running_mean,
                                 const Tensor& running_var, double momentum, double eps) {
  forward_training(BnOps::Norm, y, save_mean, save_invstd, x, Tensor(), weight, bias,
                   running_mean, running_var, momentum, eps);
}

void batch_norm_forward_eval(const Tensor& y, const Tensor& x, const Tensor& weight,
                             const Tensor& bias, const Tensor& running_mean,
                             const Tensor& running_var, double eps) {
  KILN_CHECK(running_mean.defined() && running_var.defined(),
             "batch_norm (cuda) eval: running_mean and running_var are required");
  Layout l = layout_for(x);
  l.mode = CUDNN_BATCHNORM_SPATIAL;  // inference has no persistent variant
  const int64_t c = x.size(1);
  cudnnHandle_t h = handle();
  Descs d(x.dtype(), l);
  Tensor xc = dense_in(x, l.fmt), yb = out_buffer(y, l.fmt);
  Tensor w = param_or(weight, 1.0, c, x.device()), b = param_or(bias, 0.0, c, x.device());
  Tensor rm = dense_in(running_mean, MemoryFormat::Contiguous);
  Tensor rv = dense_in(running_var, MemoryFormat::Contiguous);
  CUDNN_CHECK(cudnnBatchNormalizationForwardInference(
      h, l.mode, &kOne, &kZero, d.data.d, xc.raw_data(), d.data.d, yb.raw_data(), d.param.d,
      w.raw_data(), b.raw_data(), rm.raw_data(), rv.raw_data(), eps));
  finish_out(y, yb);
}

void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor& save_mean, const Tensor& save_invstd) {
  backward(BnOps::Norm, dx, Tensor(), dweight, dbias, dy, x, Tensor(), weight, Tensor(),
           save_mean, save_invstd, Tensor(), kDefaultEps, false);
}

Tensor batch_norm_relu_forward_training(const Tensor& y, const Tensor& save_mean,
                                        const Tensor& save_invstd, const Tensor& x,
                                        const Tensor& weight, const Tensor& bias,
                                        const Tensor& running_mean, const Tensor& running_var,
                                        double momentum, double eps) {
  check_fused("batch_norm_relu_forward_training", x);
  return forward_training(BnOps::Relu, y, save_mean, save_invstd, x, Tensor(), weight, bias,
                          running_mean, running_var, momentum, eps);
}

Tensor batch_norm_add_relu_forward_training(const Tensor& y, const Tensor& save_mean,
                                            const Tensor& save_invstd, const Tensor& x,
                                            const Tensor& z, const Tensor& weight,
                                            const Tensor& bias, const Tensor& running_mean,
                                            const Tensor& running_var, double momentum,
                                            double eps) {
  check_fused("batch_norm_add_relu_forward_training", x);
  KILN_CHECK(z.defined() && z.shape() == x.shape() && z.dtype() == x.dtype(),
             "batch_norm_add_relu_forward_training: z must match x ", x.desc(), ", got ",
             z.defined() ? z.desc() : "undefined");
  return forward_training(BnOps::AddRelu, y, save_mean, save_invstd, x, z, weight, bias,
                          running_mean, running_var, momentum, eps);
}

void batch_norm_relu_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                              const Tensor& dy, const Tensor& x, const Tensor& y,
                              const Tensor& weight, const Tensor& bias, const Tensor& save_mean,
                              const Tensor& save_invstd, const Tensor& reserve, double eps,
                              bool accumulate_params) {
  check_fused("batch_norm_relu_backward", x);
  KILN_CHECK(y.defined(), "batch_norm_relu_backward: the forward output y is required");
  backward(BnOps::Relu, dx, Tensor(), dweight, dbias, dy, x, y, weight, bias, save_mean,
           save_invstd, reserve, eps, accumulate_params);
}

void batch_norm_add_relu_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight,
                                  const Tensor& dbias, const Tensor& dy, const Tensor& x,
                                  const Tensor& y, const Tensor& weight, const Tensor& bias,
                                  const Tensor& save_mean, const Tensor& save_invstd,
                                  const Tensor& reserve, double eps, bool accumulate_params) {
  check_fused("batch_norm_add_relu_backward", x);
  KILN_CHECK(dz.defined(), "batch_norm_add_relu_backward: dz is required");
  KILN_CHECK(y.defined(), "batch_norm_add_relu_backward: the forward output y is required");
  backward(BnOps::AddRelu, dx, dz, dweight, dbias, dy, x, y, weight, bias, save_mean,
           save_invstd, reserve, eps, accumulate_params);
}

}  // namespace kiln::cuda
