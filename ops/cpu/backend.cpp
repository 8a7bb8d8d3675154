// The CPU backend's table. Most entries are the kernels of ops/cpu/kernels.h as they are; the
// adapters below give the rest the table's contract (accumulating convolution gradients,
// linear on the GEMM).
#include "ops/cpu/backend.h"

#include "ops/cpu/kernels.h"

namespace kiln::cpu {
namespace {

Allocator* allocator(int) { return cpu_allocator(); }

// `+=` as a fresh result added in: correct, though it saves nothing on the CPU.
void add_into(const Tensor& acc, const Tensor& fresh) {
  binary(BinaryOp::AddScaled, acc, acc, fresh, 1.0);
}

void conv_dgrad(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p,
                GradientMode mode) {
  if (mode != GradientMode::Accumulate) return conv2d_backward_data(dx, dy, w, p);
  Tensor fresh = empty(dx.shape(), TensorOptions(dx.dtype()));
  conv2d_backward_data(fresh, dy, w, p);
  add_into(dx, fresh);
}

void conv_wgrad(const Tensor& dw, const Tensor& dy, const Tensor& x, const ConvParams& p,
                GradientMode mode) {
  if (mode != GradientMode::Accumulate) return conv2d_backward_weight(dw, dy, x, p);
  Tensor fresh = empty(dw.shape(), TensorOptions(dw.dtype()));
  conv2d_backward_weight(fresh, dy, x, p);
  add_into(dw, fresh);
}

// y (N, out) = x·wᵀ + bias on the GEMM.
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias) {
  matmul(y, x, false, w, true);
  if (bias.defined()) binary(BinaryOp::AddScaled, y, y, bias.broadcast_to(y.shape()), 1.0);
}

void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                     const Tensor& x, const Tensor& w) {
  if (dx.defined()) matmul(dx, dy, false, w, false);  // (N, out)·(out, in)
  matmul(dw, dy, true, x, false);                     // (out, N)·(N, in)
  if (db.defined()) {
    const Tensor dyt = dy.t().contiguous();  // (out, N)
    reduce_rows(ReduceOp::Sum, db, dyt, dy.size(1), dy.size(0));
  }
}

Backend make_table() {
  Backend b;
  b.name = "cpu";
  b.allocator = allocator;
  b.copy = detail::copy_cpu;
  b.fill = detail::fill_cpu;
  b.unary = unary;
  b.binary = binary;
  b.reduce_rows = reduce_rows;
  b.reduce_cols = reduce_cols;
  b.max_rows = max_rows;
  b.scatter_rows = scatter_rows;
  b.matmul = matmul;
  b.linear_forward = linear_forward;
  b.linear_backward = linear_backward;
  b.conv2d_forward = conv2d_forward;
  b.conv2d_backward_data = conv_dgrad;
  b.conv2d_backward_weight = conv_wgrad;
  b.max_pool2d_forward = max_pool2d_forward;
  b.max_pool2d_backward = max_pool2d_backward;
  b.avg_pool2d_forward = avg_pool2d_forward;
  b.avg_pool2d_backward = avg_pool2d_backward;
  b.adaptive_avg_pool2d_forward = adaptive_avg_pool2d_forward;
  b.adaptive_avg_pool2d_backward = adaptive_avg_pool2d_backward;
  b.batch_norm_forward_training = batch_norm_forward_training;
  b.batch_norm_forward_eval = batch_norm_forward_eval;
  b.batch_norm_backward = batch_norm_backward;
  b.sync_batch_norm_stats = sync_batch_norm_stats;
  b.sync_batch_norm_apply = sync_batch_norm_apply;
  b.sync_batch_norm_backward_sums = sync_batch_norm_backward_sums;
  b.sync_batch_norm_backward_dx = sync_batch_norm_backward_dx;
  b.layer_norm_forward = layer_norm_forward;
  b.layer_norm_backward = layer_norm_backward;
  b.philox_advance = philox_advance;
  b.dropout = dropout;
  b.embedding_forward = embedding_forward;
  b.embedding_backward = embedding_backward;
  b.where = where;
  b.softmax_forward = softmax_forward;
  b.softmax_backward = softmax_backward;
  b.cross_entropy = cross_entropy_forward;
  b.fused_check_grads = fused::ref::check_grads;
  b.fused_clip_coef = fused::ref::clip_coef;
  b.fused_step_begin = fused::ref::step_begin;
  b.fused_sgd_step = fused::ref::sgd_step;
  b.fused_adamw_step = fused::ref::adamw_step;
  b.loss_scaler_update = fused::ref::update_scale;
  return b;
}

}  // namespace

const Backend& backend_table() {
  static const Backend table = make_table();
  return table;
}

}  // namespace kiln::cpu
