#pragma once
// The CUDA backend's kernels and library wrappers, as they fill the CUDA table
// (cuda/backend.cpp). Internal to cuda/ and its tests: the layers above reach them through
// kiln::backend() (core/backend.h), where each entry's contract is written. What follows adds
// only what is particular to CUDA. f32 and f16 data (f32 accumulation); batch-norm parameters
// and statistics f32; every function runs on kiln::cuda::current_stream() without
// synchronising the host unless it says so.
#include "core/backend.h"
#include "core/fused_optim.h"
#include "core/kinds.h"
#include "core/tensor.h"

namespace kiln::cuda {

// ---- copies (cuda/copy.cpp) ----
// dst = src converted to dst's dtype; same shape (the caller expands src), any devices (at least
// one cuda), dtypes and strides. Device-to-host copies synchronise before returning.
void copy_tensor(const Tensor& dst, const Tensor& src);
// Every element of the cuda tensor dst (any strides) = value converted to dst's dtype.
void fill_tensor(const Tensor& dst, double value);
// dst (A, 4, H, W) = src (A, C < 4, H, W) with channels C..3 zero, for 2-byte dtypes with
// channels innermost and dense in both (cuda/kernels/copy.cu): one pass, no fill. Returns false,
// doing nothing, for any other pair.
bool pad_channels4(const Tensor& dst, const Tensor& src);

// ---- elementwise and reductions (cuda/kernels/elementwise.cu, reduce.cu) ----
void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar);
// a and b already expanded to out's shape (zero strides where broadcast).
void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b, double alpha);
// x contiguous viewed as (rows, inner); out (rows) contiguous.
void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& x, int64_t rows, int64_t inner);
// out (cols) = Σ over the rows of contiguous x (outer, cols): two passes, f32 partial sums of
// row chunks then their sum in chunk order (deterministic for a given shape).
void reduce_cols(const Tensor& out, const Tensor& x, int64_t outer, int64_t cols);
// max over the inner dim of contiguous x (rows, inner): values and i64 indices (first max).
void max_rows(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t rows,
              int64_t inner);
// dx (rows, inner) = 0 except dx[r, indices[r]] = g[r].
void scatter_rows(const Tensor& dx, const Tensor& g, const Tensor& indices, int64_t rows,
                  int64_t inner);

// ---- matmul / linear on cuBLASLt (cuda/blas.cpp) ----
// out = op(a)·op(b) for 2-D contiguous a, b (op = transpose when the flag is set);
// batched when a, b, out are 3-D with the same batch size.
void matmul(const Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b);
// y (N, out) = x (N, in) · w (out, in)ᵀ + bias (bias in the epilogue; bias may be undefined).
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias);
// dx = dy·w (when defined), dw = dyᵀ·x, db = Σ_n dy (when defined; in the weight gradient's
// BGRADB epilogue or as a GEMM of its own, whichever was faster when the problem was first met).
void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                     const Tensor& x, const Tensor& w);
// Whether a GEMM problem met for the first time times cuBLASLt's first heuristic answers and
// keeps the fastest, and linear_backward times its two bias-gradient forms (default;
// KILN_GEMM_TUNE=0 off: the first answer, the epilogue form). Problems already met keep theirs.
void set_gemm_tuning_enabled(bool on);

// ---- convolution on cuDNN (cuda/conv.cpp) ----
// Tensors are 4-D, NCHW or NHWC strided; bias (O) or undefined. The backward outputs are `=`,
// or `+=` with accumulate (cuDNN's beta = 1 when dx/dw is dense in the problem's layout; the
// output must not share memory with the inputs).
void conv2d_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
                    const ConvParams& p);
// The forward convolution (no bias) with the per-channel sum and sum of squares of y (f32, O
// values each, `=`) from the same cuDNN kernel (a GenStats epilogue, which sums the f32 results
// before their rounding to f16, and across thread blocks in no fixed order: not bit-
// reproducible). Returns false when that is not available — f16 channels-last only, backend API
// on, a plan found for the problem that beats the plain convolution plus a statistics pass
// (tuned on first sight, like conv2d_forward; ConvBackend::Force takes any plan that runs) —
// and then y, sum and sqsum hold no result. The ResNet stem's
// convolution goes to kiln's own kernel instead (stem_conv_forward_stats below), whose statistics
// are those of y as rounded to f16 and bit-reproducible.
bool conv2d_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                          const Tensor& x, const Tensor& w, const ConvParams& p);
void conv2d_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p,
                          bool accumulate = false);
// zeroed (with accumulate): dw holds zeros. Where `+=` would run as beta = 0 into a fresh buffer
// plus an add (the tuner's choice, or a padded stem), the beta = 0 plan writes dw instead: the
// same values, one pass and one buffer fewer; where it would run beta = 1, it still does.
void conv2d_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                            const ConvParams& p, bool accumulate = false, bool zeroed = false);

// ---- the ResNet stem's convolution (cuda/kernels/stem_conv.cu) ----
// x (N, 3, H, W) f16 channels-last, w (64, 3, 7, 7) f16 (any strides), stride 2, padding 3,
// y (N, 64, OH, OW) f16 channels-last with OH a multiple of 8 and OW of 16 (224 → 112): y (=) and
// sum, sqsum (=, f32, 64 each: Σy and Σy² of y as rounded to f16) from one kernel reading the
// 3-channel x directly. Bit-reproducible for a shape and a device. conv2d_forward_stats takes it
// where stem_conv_supported and stem_conv_mode() ≥ 1.
bool stem_conv_supported(const Tensor& y, const Tensor& x, const Tensor& w, const ConvParams& p);
void stem_conv_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                             const Tensor& x, const Tensor& w, const ConvParams& p);
// Its weight gradient: dw (64, 3, 7, 7) f16 or f32, any strides, (=, or += with accumulate) from
// dy (N, 64, OH, OW) f16 channels-last and x as above; partial sums per CTA added in a fixed
// order, so bit-reproducible too. conv2d_backward_weight takes it where stem_wgrad_supported and
// stem_conv_mode() == 2.
bool stem_wgrad_supported(const Tensor& dw, const Tensor& dy, const Tensor& x,
                          const ConvParams& p);
void stem_conv_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                               const ConvParams& p, bool accumulate);
// 0: both on cuDNN; 1: kiln's forward, cuDNN's weight gradient; 2 (default): both kiln's.
// KILN_STEM_CONV=0 / forward, or set here (tests).
int stem_conv_mode();
void set_stem_conv_mode(int mode);
// Where kiln's stem kernels multiply on Hopper's wgmma (cuda/kernels/stem_conv_wgmma.cu) rather
// than mma.sync: 0 neither, 1 the forward, 2 (default) the forward and the weight gradient; the
// same tiles and epilogues, their own bits. wgmma only where built for sm_90a and running on
// sm_90: stem_wgmma_mode() says what runs (0 elsewhere). KILN_STEM_WGMMA=0 / forward, or set
// here (tests).
int stem_wgmma_mode();
void set_stem_wgmma_mode(int mode);
// Whether the stem forward's wgmma copies each row of a tile's input patch from x in 16-byte
// chunks (unpacked in shared memory) and reads its A operand from the patch by descriptor
// (default), or loads the patch by 2-byte loads and A into registers by ldmatrix (the form before
// v34); the same bits. KILN_STEM_A_SMEM=0, or set here (tests); it matters only where
// stem_wgmma_mode() >= 1.
bool stem_a_smem_enabled();
void set_stem_a_smem_enabled(bool on);
// Whether the stem weight gradient's wgmma reads its A operand from the input patch in shared
// memory by descriptor (MN-major; default) or from registers loaded by ldmatrix.trans (the form
// before v35); the same bits. KILN_STEM_WGRAD_A_SMEM=0, or set here (tests); it matters only
// where stem_wgmma_mode() == 2.
bool stem_wgrad_a_smem_enabled();
void set_stem_wgrad_a_smem_enabled(bool on);

// ---- pooling (cuda/kernels/pool.cu) ----
// Max pooling saves, per output, the window-local position i*kernel_w + j of the window's first
// maximal element (NaN counts as maximal): `indices` (N, C, OH, OW), any layout, of dtype
// max_pool2d_indices_dtype(p): u8 when the window has at most 255 positions, else i32. The
// value 255 (u8) or -1 (i32) marks a window that holds no input element (its y is -inf).
// y (N, C, OH, OW) = window maxima, indices as above (both `=`).
void max_pool2d_forward(const Tensor& y, const Tensor& indices, const Tensor& x,
                        const PoolParams& p);
// dx (N, C, H, W) = dy routed to the saved positions, summed where windows overlap (`=`, dx
// fully written; a gather without atomics, so deterministic).
void max_pool2d_backward(const Tensor& dx, const Tensor& dy, const Tensor& indices,
                         const PoolParams& p);
void avg_pool2d_forward(const Tensor& y, const Tensor& x, const PoolParams& p);
void avg_pool2d_backward(const Tensor& dx, const Tensor& dy, const PoolParams& p);
// Adaptive average pooling with PyTorch's window rule (global average pooling when 1x1).
void adaptive_avg_pool2d_forward(const Tensor& y, const Tensor& x);
void adaptive_avg_pool2d_backward(const Tensor& dx, const Tensor& dy);

// ---- batch norm on cuDNN (cuda/batchnorm.cpp) ----
// x, y: (N, C, H, W) or (N, C); weight, bias, running stats: f32 (C).
// Training: writes y, save_mean (C) and save_invstd (C) = 1/sqrt(var_biased + eps), and updates
// running_mean/var in place (when defined) with momentum and the unbiased variance.
void batch_norm_forward_training(const Tensor& y, const Tensor& save_mean,
                                 const Tensor& save_invstd, const Tensor& x, const Tensor& weight,
                                 const Tensor& bias, const Tensor& running_mean,
                                 const Tensor& running_var, double momentum, double eps);
void batch_norm_forward_eval(const Tensor& y, const Tensor& x, const Tensor& weight,
                             const Tensor& bias, const Tensor& running_mean,
                             const Tensor& running_var, double eps);
// Training-mode backward: dx (=), dweight and dbias (=) when defined.
void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor& save_mean, const Tensor& save_invstd);

// ---- fused batch norm + ReLU (+ residual add) on cuDNN (cuda/batchnorm.cpp) ----
// x, z, y: (N, C, H, W) f16 channels-last (NHWC) only — anything else is a kiln::Error naming
// the op. Forward: y = relu(bn(x)) or relu(bn(x) + z), with save_mean/save_invstd and the
// running stats as in batch_norm_forward_training. Returns the reserve space (u8, on x's
// device, possibly empty) that the matching backward needs: keep it alive with y.
Tensor batch_norm_relu_forward_training(const Tensor& y, const Tensor& save_mean,
                                        const Tensor& save_invstd, const Tensor& x,
                                        const Tensor& weight, const Tensor& bias,
                                        const Tensor& running_mean, const Tensor& running_var,
                                        double momentum, double eps);
Tensor batch_norm_add_relu_forward_training(const Tensor& y, const Tensor& save_mean,
                                            const Tensor& save_invstd, const Tensor& x,
                                            const Tensor& z, const Tensor& weight,
                                            const Tensor& bias, const Tensor& running_mean,
                                            const Tensor& running_var, double momentum,
                                            double eps);
// Backward through relu and bn (and the add): dx (=), dz (=, add variant), dweight and dbias
// (=, or += with accumulate_params: cuDNN's betaParamDiff = 1; then they must be dense f32)
// when defined. y is the forward's output, eps and reserve the forward's.
void batch_norm_relu_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                              const Tensor& dy, const Tensor& x, const Tensor& y,
                              const Tensor& weight, const Tensor& bias, const Tensor& save_mean,
                              const Tensor& save_invstd, const Tensor& reserve, double eps,
                              bool accumulate_params = false);
void batch_norm_add_relu_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight,
                                  const Tensor& dbias, const Tensor& dy, const Tensor& x,
                                  const Tensor& y, const Tensor& weight, const Tensor& bias,
                                  const Tensor& save_mean, const Tensor& save_invstd,
                                  const Tensor& reserve, double eps,
                                  bool accumulate_params = false);

// ---- layer norm (cuda/kernels/layer_norm.cu), dropout (cuda/kernels/random.cu), embedding and
// where (cuda/kernels/index.cu): the table's contracts (core/backend.h). Layer norm computes in
// f32 for f16/bf16/f32 data (f64 for f64) with f32 (f64) parameters and statistics. ----
void layer_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                        const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                        double eps);
void layer_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor& mean, const Tensor& rstd, int64_t rows, int64_t cols,
                         GradientMode mode, GradientMode dx_mode);
void philox_advance(const Tensor& base, const Tensor& offset, int64_t n);
void dropout(const Tensor& out, const Tensor& in, double p, uint64_t seed, const Tensor& base);
void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& indices);
void embedding_backward(const Tensor& dweight, const Tensor& dout, const Tensor& indices,
                        GradientMode mode);
void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);

// ---- the exact GELU of a GEMM's output plus its bias (cuda/kernels/bias_gelu.cu): the table's
// contracts (core/backend.h); f32, f16 or bf16, f32 arithmetic. ----
void bias_gelu_forward(const Tensor& out, const Tensor& y, const Tensor& bias);
void bias_gelu_backward(const Tensor& dy, const Tensor& dbias, const Tensor& dout,
                        const Tensor& y, const Tensor& bias);

// ---- fused attention (cuda/kernels/attention.cu): AttentionPaths' contracts (core/backend.h).
// attention_supported: f16 or bf16, head_dim 64 or 128, the last dim dense and every other
// stride a multiple of 8 elements with 16-byte aligned data, on an sm_80+ GPU. ----
bool attention_supported(const Tensor& q, const Tensor& k, const Tensor& v);
void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, bool causal);
void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                        const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, double scale, bool causal);

// ---- softmax and cross-entropy (cuda/kernels/softmax.cu) ----
// Over the last dim of contiguous (rows, cols).
void softmax_forward(const Tensor& y, const Tensor& x, bool log);
// dx = y*(dy - Σ dy*y) (softmax) or dy - exp(y)*Σ dy (log_softmax).
void softmax_backward(const Tensor& dx, const Tensor& dy, const Tensor& y, bool log);
// Fused softmax-cross-entropy over logits (N, C) and i64 targets (N): loss (f32 scalar, mean over
// N), grad (N, C) = (softmax - smoothed target) * grad_scale / N, and correct (i64 scalar) =
// number of rows whose argmax equals the target. grad has the logits' dtype or f32 (for 16-bit
// logits: unrounded, so a later loss scale is applied before the one rounding to 16 bits).
void cross_entropy_fused(const Tensor& loss, const Tensor& grad, const Tensor& correct,
                         const Tensor& logits, const Tensor& target, double label_smoothing,
                         double grad_scale);


// ---- sync batch norm halves (cuda/kernels/sync_batch_norm.cu) ----
// Backend::sync_batch_norm_*: x, y, dy, dx f32, f16 or bf16, all dense in ONE layout;
// per-channel tensors contiguous f32; sums in f32, deterministic (fixed per-block partials).
void sync_batch_norm_stats(const Tensor& stats, const Tensor& x);
void sync_batch_norm_apply(const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                           const Tensor& x, const Tensor& weight, const Tensor& bias,
                           const Tensor& running_mean, const Tensor& running_var,
                           const Tensor& stats, double momentum, double eps);
void sync_batch_norm_backward_sums(const Tensor& sums, const Tensor& dy, const Tensor& x,
                                   const Tensor& mean, const Tensor& invstd);
// count: a one-element f32 device tensor holding n, read on the device.
void sync_batch_norm_backward_dx(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                 const Tensor& weight, const Tensor& mean, const Tensor& invstd,
                                 const Tensor& sums, const Tensor& count);

// ---- batch norm on f16 NHWC activations with known statistics (cuda/kernels/bn_nhwc_stats.cu,
// bn_nhwc_apply.cu, bn_nhwc_backward.cu; the tail GEMM: gemm_bn.cu, gemm_bn_wgmma.cu) ----

// Whether the kernels take x: f16, 4-D, channels-last dense, C % 8 == 0, on a CUDA device.
bool bn_nhwc_supported(const Tensor& x);

// sum (=) and sqsum (=) (C, f32) = Σx and Σx² per channel over x's N·H·W rows, summed in f32 in
// a fixed order (bit-reproducible for a given shape and device). The statistics pass for a
// convolution whose kernel did not produce them (cuda/backend.cpp conv_stats).
void bn_nhwc_stats(const Tensor& sum, const Tensor& sqsum, const Tensor& x);
// Its finishing reduction alone: sum and sqsum (=) from partial (parts, 2, C) rows of Σx and Σx²
// (a kernel that wrote such partials for x, as conv1x1_forward_stats), in a fixed order.
void bn_nhwc_stats_finish(const Tensor& sum, const Tensor& sqsum, const Tensor& partial,
                          const Tensor& x, int parts);

// A 3x3 convolution, stride 1, padding 1, with its output's batch-norm statistics, on kiln's
// wgmma GEMM as an implicit GEMM (TMA's im2col loads; docs/lab/norm-conv.md): y (=) = conv(x, w),
// sum (=) and sqsum (=) as conv1x1_forward_stats gives them. Needs conv3x3_stats_supported:
// the path on (conv3x3_enabled: unless KILN_CONV3X3=0), M = N·H·W output rows at most
// conv3x3_max_rows (KILN_CONV3X3_ROWS, default 12,544; no limit with KILN_CONV3X3=1: above it
// cuDNN's tuned plans are as fast), an sm_90 GPU, f16 channels-last x (N, K, H, W) and y (N, C,
// H, W), a channels-last w (C, K, 3, 3), K a multiple of 64 up to 4,096, C a multiple of 128.
bool conv3x3_stats_supported(const Tensor& y, const Tensor& x, const Tensor& w,
                             const ConvParams& p);
void conv3x3_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                           const Tensor& x, const Tensor& w, const ConvParams& p);
bool conv3x3_enabled();
void set_conv3x3_enabled(bool on);
int64_t conv3x3_max_rows();
void set_conv3x3_max_rows(int64_t rows);

// A stride-1, unpadded 1x1 convolution's forward with its output's batch-norm statistics, on
// kiln's wgmma GEMM (cuda/kernels/gemm_bn_wgmma.cu): y (=) = x · wᵀ rounded to f16, sum (=) and
// sqsum (=) = Σy and Σy² per channel of y as stored, in a fixed order (bit-reproducible for a
// shape and device). The first piece of the NormConvolution pattern kiln builds on its own
// kernels (docs/lab/norm-conv.md). Needs conv1x1_stats_supported: an sm_90 GPU, f16
// channels-last x (N, K, H, W) and y (N, C, H, W), w (C, K, 1, 1), K a multiple of 64 up to
// 2,048, C a multiple of 128, and the switch on (KILN_CONV1X1_STATS=0 turns it off).
bool conv1x1_stats_supported(const Tensor& y, const Tensor& x, const Tensor& w,
                             const ConvParams& p);
void conv1x1_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                           const Tensor& x, const Tensor& w, const ConvParams& p);
// The same convolution of relu(bn(x)) with bn's scale and shift applied as the kernel loads x
// (scale_shift: f32 (2·K), scale then shift, BnStatsFinalize's): y, sum and sqsum are bit for bit
// conv1x1_forward_stats of the tensor bn_nhwc_apply(relu) would write, which is never written.
// Same shapes as conv1x1_stats_supported.
void conv1x1_bn_relu_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                                   const Tensor& x, const Tensor& scale_shift, const Tensor& w,
                                   const ConvParams& p);

// A stride-1, unpadded 1x1 convolution's weight gradient on kiln's wgmma kernel (cuda/kernels/
// wgrad1x1_wgmma.cu): dw (O, I, 1, 1) f16 or f32, any strides, (=, or += with accumulate) =
// Σ over the N·H·W rows of dy[m][o] · x[m][i], the rows split among the SMs and the parts added
// in a fixed order (bit-reproducible for a shape and device). Needs conv1x1_wgrad_supported: an
// sm_90 GPU, f16 channels-last dy (N, O, H, W) and x (N, I, H, W), O a multiple of 128 and I of
// 64 or the other way round, both up to 4,096, and the switch on (KILN_WGRAD1X1=0 turns it off;
// conv2d_backward_weight then runs cuDNN's).
bool conv1x1_wgrad_supported(const Tensor& dw, const Tensor& dy, const Tensor& x,
                             const ConvParams& p);
// Whether conv1x1_backward_weight takes dy and x with an f32 dw (O, I, 1, 1), stride 1.
bool conv1x1_wgrad_f32_supported(const Tensor& dy, const Tensor& x);
// The tail fold on CUDA (Backend::conv1x1_fold_prep and conv1x1_fold_weight_grad, core/backend.h;
// cuda/kernels/tail_fold.cu): w f16, every sum in f32 (its K·C² products on cuBLASLt, exact
// f32), the algorithm chosen as cuda::matmul's are. conv1x1_fold_supported:
// what FastPath::TailFold needs of the operands besides the switch (conv1x1_backward_weight with
// an f32 dw for (g, x) and for x's Gram, x's rows paired where C = 64; the statistics kernel on x).
// conv1x1_fold_weight_grad_sum: its last step alone (w·G and the sum), from gx (K, C), the gram
// (C, C) or paired (2C, 2C) and sums (C), all f32.
void conv1x1_fold_prep(const Tensor& w1, const Tensor& m2t, const Tensor& bias, const Tensor& w,
                       const Tensor& coef);
bool conv1x1_fold_supported(const Tensor& g, const Tensor& x, const Tensor& w);
void conv1x1_fold_weight_grad(const Tensor& dw, const Tensor& g, const Tensor& x, const Tensor& w,
                              const Tensor& coef);
void conv1x1_fold_weight_grad_sum(const Tensor& dw, const Tensor& gx, const Tensor& gram,
                                  const Tensor& sums, const Tensor& w, const Tensor& coef);
void conv1x1_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                             const ConvParams& p, bool accumulate);
// conv1x1_backward_weight (written, not added) with x_sum (f32, I values) = Σ over x's rows per
// channel from the same pass: the kernel's idle warps add x's tiles as they arrive, so x is read
// once for both. dw bit for bit conv1x1_backward_weight's. Where conv1x1_wgrad_x_sum_supported:
// what conv1x1_wgrad_supported takes with O a multiple of 128 (x is then the kernel's second
// operand) and KILN_CONV_PROLOGUE's orientation off, and the switch on (KILN_WGRAD_X_SUM=0 turns
// it off: the tail fold then sums x in a pass of its own).
// With x_gram (f32, I × I) defined, x's Gram xᵀx as well, from the same loads of x, where
// conv1x1_wgrad_x_gram_supported: I 64 or 128 (one tile of the kernel's width), and the switch
// on (KILN_WGRAD_X_GRAM=0: the tail fold then runs the Gram as a GEMM of its own).
bool conv1x1_wgrad_x_sum_supported(const Tensor& dw, const Tensor& dy, const Tensor& x);
bool conv1x1_wgrad_x_gram_supported(const Tensor& dw, const Tensor& dy, const Tensor& x);
void conv1x1_backward_weight_x_sum(const Tensor& dw, const Tensor& x_sum, const Tensor& dy,
                                   const Tensor& x, const Tensor& x_gram = Tensor());
bool conv1x1_wgrad_x_sum_enabled();
void set_conv1x1_wgrad_x_sum_enabled(bool on);
bool conv1x1_wgrad_x_gram_enabled();
void set_conv1x1_wgrad_x_gram_enabled(bool on);
// The same weight gradient of a convolution that read relu(bn(x)): dw = dyᵀ · relu(x·scale +
// shift) with bn's scale and shift (scale_shift: f32 (2·I), scale then shift) applied as the
// kernel loads x, bit for bit conv1x1_backward_weight of the tensor bn_nhwc_apply(relu) would
// write. Same shapes as conv1x1_wgrad_supported.
void conv1x1_bn_relu_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                                     const Tensor& scale_shift, const ConvParams& p,
                                     bool accumulate);
// Whether both prologue kernels take x (N, C, H, W) into w (O, C, 1, 1): the forward's shapes
// (conv1x1_stats_supported's) and the switches on — KILN_CONV_PROLOGUE=1 (off by default: the
// step is 0.8 ms slower with it, docs/lab/norm-conv.md, v22), KILN_WGRAD1X1 and
// KILN_CONV1X1_STATS (FastPath::BatchNormReluConv1x1; F::batch_norm_relu_conv1x1 then never
// writes relu(bn(x))).
bool conv1x1_bn_relu_supported(const Tensor& x, const Tensor& w);
bool conv1x1_bn_relu_enabled();
// KILN_PROLOGUE_F16=1 (an experiment, off by default): the prologue's factors in f16 and one
// half-precision fused multiply-add and ReLU per pair of values — about a seventh of the
// instructions of the f32 form, and no longer the composition's bits (close to them). The shift
// β − μ·scale can exceed f16's range (a near-constant channel with a large mean: every output 0),
// so this affine form is not for a default; docs/lab/norm-conv.md, "f16 factors", has the
// centred form that is safe.
bool prologue_f16_enabled();
void set_prologue_f16_enabled(bool on);
void set_conv1x1_bn_relu_enabled(bool on);
bool conv1x1_wgrad_enabled();
void set_conv1x1_wgrad_enabled(bool on);

// BnStatsFinalize's outputs from its inputs (core/backend.h has the arithmetic's contract).
void bn_nhwc_finalize(const BnStatsFinalize& f);

// y (=) = act(x·scale + shift [+ z]) per channel (act: identity, ReLU or GELU); scale and
// shift are f's scale_shift, f finalized first when it has statistics (f.sum defined; otherwise
// its scale_shift is the input). z may be undefined (and must be for GELU). With ReLU and z,
// `mask` (u8, numel/8, contiguous) (=) gets the ReLU's mask, bit j of byte i set when y's
// element 8i + j is positive: the backward reads it instead of y (1/16 of the bytes). GELU is
// evaluated on the f32 value before rounding (the unfused pair rounds it to f16 in between).
void bn_nhwc_apply(const Tensor& y, const Tensor& x, const Tensor& z, const BnStatsFinalize& f,
                   Activation act, const Tensor& mask = Tensor());

// Backward of bn_nhwc_apply. g = dy through the activation: for ReLU masked by the forward's
// `mask` when z was given, else by x·scale + shift > 0 recomputed; for GELU dy·gelu'(x·scale +
// shift) recomputed from x. Writes dx (=), dz (=) = g when defined, dweight (=) = Σ g·x̂ and
// dbias (=) = Σ g when defined, x̂ = (x - mean)·invstd — or `+=` with accumulate_params
// (autograd's accumulate-into: they are the parameters' .grad).
void bn_nhwc_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight,
                      const Tensor& dbias, const Tensor& dy, const Tensor& x, const Tensor& mask,
                      const Tensor& weight, const Tensor& save_mean, const Tensor& save_invstd,
                      const Tensor& scale_shift, Activation act, bool accumulate_params = false);

// The ResNet stem's batch norm + ReLU + max pool in one pass: y (=) = max_pool2d(relu(x·scale +
// shift), 3x3, stride 2, padding 1) and indices (=) (u8, y's shape, channels-last: the window
// position 0-8 of each maximum), bit for bit bn_nhwc_apply(relu) then max_pool2d_forward; the
// normalised tensor is never written. max_pool2d_backward with these indices, then
// bn_nhwc_backward (relu, mask recomputed from x), is the backward. at_max (=), when defined (f16,
// y's shape and layout): x itself at each maximum, the one input value per output and channel
// through which the gradient flows — what the backward's sums need (below).
void bn_nhwc_relu_max_pool(const Tensor& y, const Tensor& indices, const Tensor& at_max,
                           const Tensor& x, const Tensor& scale_shift);
// Whether bn_nhwc_relu_max_pool runs on 8 × 8-output tiles (each input normalised once into
// shared memory; default) or one output per thread: the same bits either way.
// KILN_STEM_POOL_TILE=0, or set here (tests, kiln-fusion-probe).
bool stem_pool_tile_enabled();
void set_stem_pool_tile_enabled(bool on);
// Whether the stem pool's forward saves at_max for its backward (default) or the backward's sums
// read all of x. KILN_STEM_POOL_AT_MAX=0, or set here (tests, kiln-fusion-probe).
bool stem_pool_at_max_enabled();
void set_stem_pool_at_max_enabled(bool on);
// Whether the tiled forward, writing at_max, keeps its input tile as read in shared memory and
// takes at_max from there (default) or gathers it from x in global memory: the same bits.
// KILN_STEM_POOL_RAW_TILE=0, or set here (tests, kiln-fusion-probe).
bool stem_pool_raw_tile_enabled();
void set_stem_pool_raw_tile_enabled(bool on);
// Whether bn_nhwc_relu_max_pool_backward on x would sum from at_max: the switch on and x's
// channels in its own kernels' layout (else it runs the composition, which reads all of x).
bool relu_max_pool_backward_uses_at_max(const Tensor& x);

// Its backward: dy (the pool's output gradient) through the pool (the forward's indices) and
// the ReLU (mask recomputed from x) to dx (=), with dweight and dbias (= or += with
// accumulate_params, when defined) — what max_pool2d_backward then bn_nhwc_backward give, in two
// passes that rebuild the pool's gradient from dy instead of writing and reading it. With at_max
// (the forward's, or undefined) the batch norm's sums Σg and Σg·(x − mean) run over the pool's
// outputs — dy masked by the ReLU at x = at_max, one term per output — reading dy and at_max
// (a quarter of x's bytes each) instead of all of x with dy and indices; a pixel that is the
// maximum of several windows then adds their gradients in f32 where the composition rounds their
// sum to f16 first, so dweight and dbias agree with it to rounding. dx is rebuilt from indices and
// x either way.
void bn_nhwc_relu_max_pool_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                    const Tensor& dy, const Tensor& indices, const Tensor& at_max,
                                    const Tensor& x, const Tensor& weight, const Tensor& save_mean,
                                    const Tensor& save_invstd, const Tensor& scale_shift,
                                    bool accumulate_params = false);

// The backward of bn_nhwc_apply(relu, z) — a ResNet block's tail relu(bn(x) + z) — whose output
// gradient is a stride-1 1x1 convolution's data gradient added onto r (the next block's conv1
// and its identity shortcut): G = dy1·w1 + r (dy1 (N, K, H, W) the convolution's output
// gradient, w1 (K, C, 1, 1) its weight), computed with the batch norm's first pass in one GEMM
// (cuda/kernels/gemm_bn.cu), then one pass for dx. g (=) = G masked by `mask` (the forward's
// ReLU bits) — the gradient of z, and of the block's input through the shortcut; dx (=),
// dweight, dbias as bn_nhwc_backward's. Needs dgrad1x1_bn_supported (K 64 or 128, C % 64 ==
// 0: ResNet-50's layers 1 and 2, where it beats cuDNN + kiln's passes; docs/lab/tail-gemm.md;
// on sm_90 also K a multiple of 64 up to 2,048 with C % 128 == 0, on the wgmma kernel, since
// v15); the result equals cuDNN's dgrad (beta = 1) then bn_nhwc_backward to rounding (the GEMM
// adds in another order).
//
// Also the backward of bn_nhwc_apply(relu) without z — a block's inner relu(bn2(y2)), read only
// by the 1x1 conv3 — with `mask` undefined: the ReLU mask is then recomputed from x and
// scale_shift (the forward's, as bn_nhwc_backward's relu does), r may be undefined (no other
// gradient), and g is G masked (scratch for the dx pass). The wgmma kernel only:
// dgrad1x1_bn_supported(dy1, w1, x, /*mask_bits=*/false).
//
// w1 may also be a 3x3 convolution's weight (K, C, 3, 3), channels-last: the convolution then
// has stride 1 and padding 1 (a bottleneck's conv2 reading relu(bn1(y1)), or a basic block's
// conv reading a tail), and G = dgrad(dy1, w1) (+ r) is computed by kiln's implicit GEMM on
// sm_90 (dy1 through TMA's im2col loads, w1 read per tap as it lies), with the same epilogue
// and contract as the 1x1 form. Needs dgrad3x3_bn_supported.
bool dgrad1x1_bn_supported(const Tensor& dy1, const Tensor& w1, const Tensor& x,
                           bool mask_bits = true);
// The 3x3 form: KILN_DGRAD3X3 on, an sm_90 GPU and a build for sm_90a, f16 channels-last dy1
// (N, K, H, W), w1 (K, C, 3, 3) and x (N, C, H, W), K a multiple of 64 up to 4,096, C a
// multiple of 128 (any mask form: the forward's bits, or recomputed from x).
bool dgrad3x3_bn_supported(const Tensor& dy1, const Tensor& w1, const Tensor& x);
// Whether w1 is a 3x3 weight (K, C, 3, 3): which form the calls above take.
bool dgrad_weight_3x3(const Tensor& w1);
// (N, C, ⌈H/2⌉, ⌈W/2⌉) for x (N, C, H, W): the shape of a stride-2 unpadded 1x1 convolution's
// data gradient kept at x's even pixels alone, which bn_nhwc_backward_dgrad and
// dgrad1x1_bn_sums take as r (compact; zero at the other pixels) with the mask bits.
Shape stride2_grad_shape(const Tensor& x);
// Whether that compact r is read as it is (the wgmma kernel's tail form in KILN_TAIL_GEMM's
// default mode, its TMA epilogue on, the mask bits; x f16 with C a multiple of 128), not
// scattered into x's shape first: where handing it compact pays.
bool dgrad1x1_bn_stride2_supported(const Tensor& x, const Tensor& mask);
// Whether the 3x3 form runs (KILN_DGRAD3X3: on by default, off in v25, on again since v26; see
// core/switches.h; set here for tests and A/B runs).
bool dgrad3x3_enabled();
void set_dgrad3x3_enabled(bool on);
// Whether kiln's 3x3 GEMMs (this data gradient and conv3x3_forward_stats) take 256-row tiles
// where those fill the SMs' rounds (KILN_GEMM_TALL=1; off by default since v25; see
// gemm_bn_wgmma.cu's kTall). The same y and g bits either way (the tests check); the statistics'
// partial rows group the rows differently.
bool gemm_tall_enabled();
void set_gemm_tall_enabled(bool on);
// With coef_out defined (3C f32, contiguous) the dx pass is not run and dx may be undefined:
// coef_out (=) gets the batch norm's backward factors, dx = coef[c]·g + coef[C + c]·x +
// coef[2C + c] (BatchNormStatsPaths::backward_dgrad_coef).
void bn_nhwc_backward_dgrad(const Tensor& dx, const Tensor& g, const Tensor& dweight,
                            const Tensor& dbias, const Tensor& dy1, const Tensor& w1,
                            const Tensor& r, const Tensor& mask, const Tensor& x,
                            const Tensor& weight, const Tensor& save_mean,
                            const Tensor& save_invstd, bool accumulate_params = false,
                            const Tensor& scale_shift = Tensor(),
                            const Tensor& coef_out = Tensor(), const Tensor& x2 = Tensor(),
                            const Tensor& w2 = Tensor(), const Tensor& b2 = Tensor());
// Its GEMM alone: g as above and partial (parts, 2, C) (=): per part Σg and Σg·(x − mean) over
// its rows; returns parts = dgrad1x1_bn_parts(N·H·W, C, K).
// With x2 defined (dgrad1x1_bn_linear_supported; r and the mask undefined): g is formed from
// dgrad(dy1, w1) + x2 · w2ᵀ + b2 in one GEMM (x2 (N, C2, H, W) channels-last f16 at x's
// positions, w2 (C, C2) and b2 (C) f16 contiguous).
int dgrad1x1_bn_sums(const Tensor& g, const Tensor& partial, const Tensor& dy1, const Tensor& w1,
                     const Tensor& r, const Tensor& mask, const Tensor& x, const Tensor& mean,
                     const Tensor& scale_shift = Tensor(), const Tensor& x2 = Tensor(),
                     const Tensor& w2 = Tensor(), const Tensor& b2 = Tensor());
// Whether dgrad1x1_bn_sums takes x2 · w2ᵀ + b2 with dy1 and w1 (a 1x1 w1, the mask recomputed
// from x): the wgmma kernel (an sm_90 GPU) with K + C2 a multiple of 64 up to 2,048, and the
// switch on (KILN_TAIL_FOLD_T; off: the tail fold writes t and the GEMM adds it as r).
bool dgrad1x1_bn_linear_supported(const Tensor& dy1, const Tensor& w1, const Tensor& x,
                                  const Tensor& x2, const Tensor& w2, const Tensor& b2);
int dgrad1x1_bn_parts(int64_t M, int64_t C, int64_t K);
// The same for a 3x3 w (dgrad3x3_bn_supported).
int dgrad3x3_bn_parts(int64_t M, int64_t C);
// Which GEMM takes it: 0 the mma.sync kernel only (K 64, 128), 1 the wgmma kernel where the
// mma.sync kernel does not go (K 256, 512), 2 (default) the wgmma kernel wherever it fits, the
// mma.sync kernel elsewhere. KILN_TAIL_GEMM=mma / mixed, or set here (tests).
int tail_gemm_mode();
void set_tail_gemm_mode(int mode);

// Two batch norms meeting at a residual add, as at the end of a ResNet block whose shortcut is
// a convolution + batch norm: y (=) = relu(x·scale_shift_x + r·scale_shift_r), with `mask` (=)
// and both finalizes as in bn_nhwc_apply. One pass instead of two, and the shortcut's
// normalised tensor is never written.
void bn_nhwc_dual_apply(const Tensor& y, const Tensor& x, const BnStatsFinalize& f_x,
                        const Tensor& r, const BnStatsFinalize& f_r, const Tensor& mask);

// Its backward: g = dy masked by `mask`; dx (=) and dr (=) as bn_nhwc_backward's dx for each
// side; dweight_x/dbias_x and dweight_r/dbias_r (=, or += with accumulate_params) when
// defined (Σ g·x̂ and Σ g per side).
void bn_nhwc_dual_backward(const Tensor& dx, const Tensor& dr, const Tensor& dweight_x,
                           const Tensor& dbias_x, const Tensor& dweight_r, const Tensor& dbias_r,
                           const Tensor& dy, const Tensor& mask, const Tensor& x,
                           const Tensor& weight_x, const Tensor& mean_x, const Tensor& invstd_x,
                           const Tensor& r, const Tensor& weight_r, const Tensor& mean_r,
                           const Tensor& invstd_r, bool accumulate_params = false);

// The same backward where dy = dgrad(dy1, w1) + dy_rest is a stride-1 1x1 convolution's data
// gradient (the next block's conv1 reading this block's output) added onto the other consumers'
// gradient dy_rest (undefined: none): one GEMM with all three sums in its epilogue (Σg,
// Σg·(x − mean_x), Σg·(r − mean_r), the wgmma kernel's dual form), then both sides' finish and
// one apply pass reading the GEMM's g — instead of the convolution's data gradient, the add,
// bn_nhwc_dual_backward's sums pass and its apply. g is as the tail form's (dgrad1x1_bn_sums):
// acc + dy_rest rounded to f16 once, masked. Needs dual_dgrad_supported(dy1, w1, x).
bool dual_dgrad_supported(const Tensor& dy1, const Tensor& w1, const Tensor& x);
void bn_nhwc_dual_backward_dgrad(const Tensor& dx, const Tensor& dr, const Tensor& dweight_x,
                                 const Tensor& dbias_x, const Tensor& dweight_r,
                                 const Tensor& dbias_r, const Tensor& dy1, const Tensor& w1,
                                 const Tensor& dy_rest, const Tensor& mask, const Tensor& x,
                                 const Tensor& weight_x, const Tensor& mean_x,
                                 const Tensor& invstd_x, const Tensor& r, const Tensor& weight_r,
                                 const Tensor& mean_r, const Tensor& invstd_r,
                                 bool accumulate_params = false);
// The same without dx, for the tail fold (BatchNormStatsPaths::dual_backward_dgrad_coef): g (=,
// x's shape and layout) gets the GEMM's masked gradient, coef (6C f32, =) both sides' factors
// (x's first: x's gradient is coef[c]·g + coef[C + c]·x + coef[2C + c], for conv3 to take as
// factors), and the apply pass writes dr alone, reading neither x nor writing dx. dr undefined:
// r's side goes as factors too (to the shortcut's convolution), and there is no apply pass.
void bn_nhwc_dual_backward_dgrad_coef(const Tensor& coef, const Tensor& g, const Tensor& dr,
                                      const Tensor& dweight_x, const Tensor& dbias_x,
                                      const Tensor& dweight_r, const Tensor& dbias_r,
                                      const Tensor& dy1, const Tensor& w1, const Tensor& dy_rest,
                                      const Tensor& mask, const Tensor& x, const Tensor& weight_x,
                                      const Tensor& mean_x, const Tensor& invstd_x,
                                      const Tensor& r, const Tensor& weight_r,
                                      const Tensor& mean_r, const Tensor& invstd_r,
                                      bool accumulate_params = false);
// Whether the dual form runs (on by default since v27, docs/lab/norm-conv.md; KILN_DUAL_DGRAD=0
// turns it off; set here for tests and A/B runs).
bool dual_dgrad_enabled();
void set_dual_dgrad_enabled(bool on);
// Whether the tail fold's t = a2 · w2ᵀ + b2 is a second product in bn2's data-gradient GEMM
// (dgrad1x1_bn_linear_supported; KILN_TAIL_FOLD_T), not written by a GEMM of its own and added as
// r; set here for tests and A/B runs.
bool tail_fold_t_enabled();
void set_tail_fold_t_enabled(bool on);
// Whether dgrad1x1_bn_sums takes x of 64 channels with the mask recomputed from x (and x2 of c2
// channels, 0 without): kiln's wgmma GEMM on x's rows in pairs, a (M/2) × 128 view, B
// block-diagonal (w twice), the statistics' column pairs added after; M = N·H·W even, 2K (+ 2c2)
// a multiple of 64 up to 2,048, and the switch on (KILN_DGRAD_PAIR64; off: cuDNN's data gradient
// and two passes). A ResNet's layer-1 bn2 then takes conv3's data gradient, folded or not.
bool dgrad1x1_bn_pair64(const Tensor& dy1, const Tensor& w1, const Tensor& x, int64_t c2);
bool dgrad_pair64_enabled();
void set_dgrad_pair64_enabled(bool on);

// ---- fused optimizer, gradient checks and loss scaler (cuda/kernels/optim.cu) ----
// One launch over all chunks: found_inf (|=) and partial_sumsq (=, one per chunk).
void fused_check_grads(const fused::CheckArgs& a);
// <<<1, 256>>>: total norm and clip coefficient from the partial sums (fixed summation order,
// so replays are bit-identical).
void fused_clip_coef(const float* partial, int64_t n, const float* scale, float max_norm,
                     float* norm, float* coef);
// <<<1, 1>>>: *step += 1 unless *found_inf (found_inf may be null).
void fused_step_begin(int32_t* step, const float* found_inf);
// One launch each over all chunks; nothing is written when *found_inf != 0.
void fused_sgd_step(const fused::StepArgs& a);
void fused_adamw_step(const fused::StepArgs& a);
// <<<1, 1>>>: the scaler's update (scale, growth tracker, skipped count).
void loss_scaler_update(const fused::ScalerArgs& a);

}  // namespace kiln::cuda
