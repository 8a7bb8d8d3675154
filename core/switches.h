#pragma once
// kiln's environment switches, for measurements and bisecting: the one place that reads KILN_*
// variables. They are read once, on first use, and never change afterwards (programs and tests
// that flip a behaviour at run time use the setters beside it: cuda::set_conv_backend,
// set_accumulate_into_enabled, ...). vN below: the ResNet-50 step's version a default arrived in
// (docs/performance.md has the versions and their measurements).
//
// | variable                 | values              | effect                                          |
// |--------------------------|---------------------|-------------------------------------------------|
// | KILN_FUSED_BN            | 0                   | unfused batch norm, ReLU and add                |
// | KILN_FUSED_DGRAD         | 0                   | a block tail's BN backward does not take the    |
// |                          |                     | next 1x1 convolution's data gradient into its   |
// |                          |                     | own GEMM (before v14)                           |
// | KILN_FUSED_DGRAD_RELU    | 0                   | a block's inner relu(bn2(y2)) backward does not |
// |                          |                     | take conv3's data gradient into its GEMM (the   |
// |                          |                     | tail's fusion only; before 2026-12-04)          |
// | KILN_CONV1X1_STATS       | 0                   | 1x1 convolutions with batch-norm statistics on  |
// |                          |                     | cuDNN (GenStats epilogue or the statistics      |
// |                          |                     | pass), not kiln's wgmma kernel (before          |
// |                          |                     | 2026-12-04)                                     |
// | KILN_STATS_MIN_C         | N > 0 (default 128) | the fewest output channels at which a           |
// |                          |                     | convolution into a batch norm gives kiln's BN   |
// |                          |                     | kernels its statistics (kiln's 1x1 GEMM, or the |
// |                          |                     | plain convolution and the statistics pass) even |
// |                          |                     | where cuDNN's fused BN could run (256 was the   |
// |                          |                     | default before v31: layer 2 on cuDNN's BN)      |
// | KILN_PDL                 | 0                   | kiln's kernels launch only after the previous   |
// |                          |                     | kernel ends (no programmatic dependent launch;  |
// |                          |                     | before v14)                                     |
// | KILN_TAIL_GEMM           | mma, mixed          | a block tail's fused data-gradient GEMM: the    |
// |                          |                     | mma.sync kernel only (K 64 and 128) / the wgmma |
// |                          |                     | kernel for K 256 and 512 only (v15–v16)         |
// |                          |                     | (default: the wgmma kernel wherever it fits, on |
// |                          |                     | sm_90; v17)                                     |
// | KILN_TAIL_TMA_EPI        | 0                   | the wgmma tail GEMM reads r, x and the mask     |
// |                          |                     | from global memory after its MMAs, not by TMA   |
// |                          |                     | during them (before v17)                        |
// | KILN_TAIL_W_DIRECT       | 0                   | the wgmma GEMMs' weight transposed by a kernel  |
// |                          |                     | first, not read N-major as it lies (before      |
// |                          |                     | 2026-12-04)                                     |
// | KILN_WGMMA_PIPELINE      | 0                   | the wgmma GEMM waits for each k-step's MMAs     |
// |                          |                     | before it issues the next (before v21)          |
// | KILN_WGRAD1X1            | 0                   | stride-1 1x1 weight gradients on cuDNN, not on  |
// |                          |                     | kiln's wgmma kernel (before 2026-12-04's v22)   |
// | KILN_CONV_PROLOGUE       | 1                   | a bottleneck's relu(bn2(y2)) applied as conv3's |
// |                          |                     | kernels load y2, never written (layers 2-4):    |
// |                          |                     | the same bits, 0.39 GiB less reserved, but      |
// |                          |                     | 0.3-0.4 ms slower at b256 (off by default;      |
// |                          |                     | docs/lab/norm-conv.md, v22-v23); 1x1 weight     |
// |                          |                     | gradients then take x as A where it fits        |
// | KILN_PROLOGUE_F16        | 1                   | with KILN_CONV_PROLOGUE=1: the factors applied  |
// |                          |                     | in f16 (an experiment: level in speed, not the  |
// |                          |                     | composition's bits; v23). Not for a default:    |
// |                          |                     | its shift overflows f16 on a near-constant      |
// |                          |                     | channel (norm-conv.md, "f16 factors")           |
// | KILN_CONV3X3             | 0, 1                | stride-1 padding-1 3x3 convolutions (C a        |
// |                          |                     | multiple of 128) on cuDNN only (0) / on kiln's  |
// |                          |                     | implicit GEMM at every size (1) (default: kiln's|
// |                          |                     | where M = N·H·W <= KILN_CONV3X3_ROWS; v44)      |
// | KILN_CONV3X3_ROWS        | N >= 0 (default     | the most output rows M of a 3x3 convolution on  |
// |                          | 12544)              | kiln's implicit GEMM (ResNet-50: layer 4 at     |
// |                          |                     | b256, layers 3-4 at b64; level above, where     |
// |                          |                     | cuDNN's tuned plans catch up)                   |
// | KILN_DGRAD3X3            | 0                   | a 3x3 stride-1 convolution's data gradient on   |
// |                          |                     | cuDNN then the sums pass, not on kiln's         |
// |                          |                     | implicit GEMM with the batch norm's sums in its |
// |                          |                     | epilogue (layers 2-4's conv2 into bn1; on in    |
// |                          |                     | v24, off in v25, on again since v26: level on   |
// |                          |                     | Imagenette; docs/lab/norm-conv.md, v26)         |
// | KILN_GEMM_TALL           | 1                   | kiln's 3x3 GEMMs on 256-row tiles where those   |
// |                          |                     | fill the SMs (on in v24; off since v25, whose   |
// |                          |                     | Imagenette runs trained worse; level in the     |
// |                          |                     | step on 2026-12-05, so off; norm-conv.md v27)   |
// | KILN_GEMM_B_RESIDENT     | 0                   | kiln's 1x1 GEMMs load B with every row tile,    |
// |                          |                     | not once per CTA where K <= 256 (v25)           |
// | KILN_DUAL_DGRAD          | 0                   | a downsample block's two batch norms' backward  |
// |                          |                     | on cuDNN's conv1 data gradient and three passes,|
// |                          |                     | not kiln's GEMM with all three sums in its      |
// |                          |                     | epilogue (on since 2026-12-05; norm-conv.md v27)|
// | KILN_TAIL_FOLD           | 0                   | an identity block tail's batch-norm backward    |
// |                          |                     | writes dy3 in a pass for conv3, instead of      |
// |                          |                     | handing conv3 its factors (the tail fold, on    |
// |                          |                     | since v37: ops/dgrad_sink.h, norm-conv.md)      |
// | KILN_TAIL_FOLD_MIN       | N >= 0 (default     | the fewest elements of conv3's input that fold  |
// |                          | 10000000)           | (ResNet-50: layers 1-3 at b256, layer 1 at b64; |
// |                          |                     | 20000000 before v44)                            |
// | KILN_TAIL_FOLD_DUAL      | 0                   | a downsample block's tail writes conv3's output |
// |                          |                     | gradient in its pass instead of folding conv3's |
// |                          |                     | side (on since v39; norm-conv.md)               |
// | KILN_TAIL_FOLD_SHORTCUT  | 0                   | a downsample tail that folds conv3's side writes|
// |                          |                     | the shortcut's gradient in its pass, not handing|
// |                          |                     | a stride-1 1x1 shortcut convolution (ResNet-50's|
// |                          |                     | layer 1) its factors too (on since v43;         |
// |                          |                     | norm-conv.md)                                   |
// | KILN_DGRAD_STRIDE2       | 0                   | a stride-2 1x1 convolution (a downsample block's|
// |                          |                     | shortcut) writes its whole data gradient, zeros |
// |                          |                     | included, not its even pixels alone handed to   |
// |                          |                     | the block tail's GEMM behind it (norm-conv.md,  |
// |                          |                     | v45)                                            |
// | KILN_WGRAD_X_SUM         | 0                   | the tail fold sums conv3's input in a pass of   |
// |                          |                     | its own, not in the weight gradient's idle warps|
// |                          |                     | (cuda/kernels/wgrad1x1_wgmma.cu)                |
// | KILN_TAIL_FOLD_T         | 0                   | the tail fold's t (a2's linear map) written by a|
// |                          |                     | GEMM of its own and added as r in bn2's data-   |
// |                          |                     | gradient GEMM, not a second product inside that |
// |                          |                     | GEMM (on since v42; norm-conv.md)               |
// | KILN_DGRAD_PAIR64        | 0                   | a 64-channel relu(bn(x)) takes the next 1x1     |
// |                          |                     | convolution's data gradient on cuDNN and two    |
// |                          |                     | passes, not in kiln's GEMM on x's rows in pairs |
// |                          |                     | (128 columns, B block-diagonal; on since v43;   |
// |                          |                     | norm-conv.md)                                   |
// | KILN_WGRAD_X_GRAM        | 0                   | the tail fold's Gram of conv3's input as a GEMM |
// |                          |                     | of its own, not from the weight gradient's loads|
// |                          |                     | of that input (since v41; norm-conv.md)         |
// | KILN_STEM_POOL_TILE      | 0                   | the stem's batch norm + ReLU + max pool forward |
// |                          |                     | one output per thread, each input normalised    |
// |                          |                     | 2.25 times, not on 8 x 8-output tiles in shared |
// |                          |                     | memory (the same bits; docs/lab/stem.md)        |
// | KILN_STEM_POOL_AT_MAX    | 0                   | the stem pool's backward sums read all of x,    |
// |                          |                     | not x at each maximum saved by the forward      |
// |                          |                     | (before v29; docs/lab/stem.md)                  |
// | KILN_STEM_POOL_RAW_TILE  | 0                   | the pool forward gathers x at each maximum from |
// |                          |                     | global memory, not from its input tile kept in  |
// |                          |                     | shared memory (the same bits)                   |
// | KILN_STEM_CONV           | 0, forward          | the ResNet stem's 7x7/2 convolution on cuDNN    |
// |                          |                     | (channel pad, plain kernel, statistics pass;    |
// |                          |                     | before v18) / kiln's kernel for the             |
// |                          |                     | forward only, its weight gradient on cuDNN      |
// | KILN_STEM_WGMMA          | 0, forward          | kiln's stem convolution kernels multiply on     |
// |                          |                     | mma.sync, not wgmma / only the forward on wgmma |
// |                          |                     | (before v29)                                    |
// | KILN_STEM_A_SMEM         | 0                   | the stem forward's wgmma loads its patch by     |
// |                          |                     | 2-byte loads and its A into registers by        |
// |                          |                     | ldmatrix, not by 16-byte copies and read by     |
// |                          |                     | descriptor (the same bits; before v34)          |
// | KILN_STEM_WGRAD_A_SMEM   | 0                   | the stem's weight gradient loads A into         |
// |                          |                     | registers by ldmatrix.trans, not read from the  |
// |                          |                     | patch by descriptor (the same bits; before v35) |
// | KILN_GRAD_OVERWRITE      | 0                   | ClassifierStep's backward adds onto the .grads  |
// |                          |                     | zero_grad just zeroed (before v16)              |
// | KILN_ACCUMULATE_GRADS    | 0                   | autograd sums gradients with separate adds      |
// | KILN_CUDNN_BACKEND       | 0, force            | convolutions on cuDNN's legacy API only / on    |
// |                          |                     | the backend API's plans whenever one runs       |
// | KILN_CUDNN_FIND_LOG      | 1                   | print every convolution's tuning                |
// | KILN_CONV_CANDIDATES     | N > 0 (default 10)  | backend-API plans timed per convolution problem |
// | KILN_TUNE_COLD           | 0, 1                | rank a convolution's plans by their time with   |
// |                          |                     | L2 overwritten before each run (1) or warm (0)  |
// | KILN_CONV_PLANS          | a file path         | the convolution tuner's choices are read from   |
// |                          |                     | and written to that file (cuda/conv.h)          |
// | KILN_JPEG_TRACE          | 1                   | the GPU JPEG path prints where each epoch's     |
// |                          |                     | time went (data/gpu_jpeg.cpp)                   |
// | KILN_ALLOC_TRACE         | a file path         | the CUDA allocator logs its events there        |
// | KILN_JPEG_STALL_S        | seconds > 0         | the GPU JPEG path's stall timeout (default 120; |
// |                          |                     | GpuJpegLoader::set_stall_timeout)               |
// | KILN_JPEG_TEST_STALL     | CALL:SECONDS        | a test of the GPU JPEG path's failover: the     |
// |                          |                     | decode stream of every GPU JPEG loader stops    |
// |                          |                     | draining for SECONDS after its CALL-th nvJPEG   |
// |                          |                     | call (from 0; GpuJpegLoader::set_test_stall)    |
// | KILN_ROW_KERNELS         | 0                   | layer norm on its generic kernels and GELU      |
// |                          |                     | through the run-time-op elementwise kernel      |
// |                          |                     | (before 2026-12-03's register-row layer norm    |
// |                          |                     | and fixed-op GELU)                              |
// | KILN_CUDNN_ATTENTION     | 0                   | attention on kiln's own kernels only, not on    |
// |                          |                     | cuDNN's fused SDPA graphs (cuda/                |
// |                          |                     | cudnn_attention.h; on by default since its      |
// |                          |                     | backward's tail mask, docs/lab/transformer.md)  |
// | KILN_CUDNN_TAIL_MASK     | 0                   | cuDNN attention's backward without its tail     |
// |                          |                     | mask where L % 128 != 0: 5% faster in vit_b_16, |
// |                          |                     | NaN in dQ on cuDNN 9.14 (sdpa::                 |
// |                          |                     | tail_mask_needed); for measuring newer cuDNNs   |
// | KILN_GEMM_TUNE           | 0                   | every cuBLASLt GEMM on the heuristic's first    |
// |                          |                     | algorithm, untimed, and a Linear's bias         |
// |                          |                     | gradient in its weight-gradient GEMM's epilogue |
// |                          |                     | (before 2026-12-03's tuning; cuda/blas.cpp)     |
// | KILN_GEMM_TUNE_LOG       | 1                   | print every GEMM problem's tuning               |
//
// Retired with their closed experiments (the old paths they kept are gone or are the general
// fallback): KILN_CONV_STATS, KILN_BN_STATS_PASS, KILN_FUSED_STEM, KILN_WGRAD_FRESH,
// KILN_BN_SUMS_BLOCKS (the one-wave sums of v14 are the only sizing now); their
// measurements stay in docs/lab/ and docs/performance.md.
//
// Launch settings are not switches: KILN_RDZV_PORT and KILN_LAUNCHER are read with the
// launchers' own variables (RANK, SLURM_PROCID, ...) in tools/train/dist_env.h.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

namespace kiln {

struct Switches {
  bool fused_bn = true;
  bool fused_dgrad = true;
  bool fused_dgrad_relu = true;
  bool conv1x1_stats = true;
  int64_t stats_min_channels = 128;
  int tail_gemm = 2;  // 0 mma.sync only, 1 wgmma where mma.sync does not go, 2 wgmma everywhere
  bool tail_tma_epi = true;
  bool tail_w_direct = true;
  bool wgmma_pipeline = true;
  bool wgrad1x1 = true;
  bool conv_prologue = false;
  bool conv3x3 = true;
  int conv3x3_max_rows = 12544;
  bool dgrad3x3 = true;
  bool gemm_tall = false;
  bool gemm_b_resident = true;
  bool dual_dgrad = true;
  bool tail_fold = true;
  int tail_fold_min = 10000000;
  bool tail_fold_dual = true;
  bool tail_fold_shortcut = true;
  bool dgrad_stride2 = true;
  bool wgrad_x_sum = true;
  bool wgrad_x_gram = true;
  bool wgrad_sum_fence = true;
  bool tail_fold_t = true;
  bool dgrad_pair64 = true;
  bool stem_pool_tile = true;
  bool stem_pool_at_max = true;
  bool stem_pool_raw_tile = true;
  bool prologue_f16 = false;
  int stem_conv = 2;  // 0 cuDNN, 1 kiln's kernel forward only, 2 forward and weight gradient
  int stem_wgmma = 2;  // 0 mma.sync, 1 the forward on wgmma, 2 the forward and weight gradient
  bool stem_a_smem = true;
  bool stem_wgrad_a_smem = true;
  bool pdl = true;
  bool accumulate_grads = true;
  bool grad_overwrite = true;
  int cudnn_backend = 1;  // 0 off, 1 auto, 2 force (cuda::ConvBackend)
  bool cudnn_find_log = false;
  size_t conv_candidates = 10;
  bool tune_cold = false;
  std::string conv_plans;  // empty: off (cuda/conv.h, set_conv_plan_file)
  bool jpeg_trace = false;
  std::string alloc_trace;  // empty: off (cuda/allocator.cpp has the format)
  double jpeg_stall_s = 0;  // 0: GpuJpegLoader's default
  int64_t jpeg_test_stall_call = -1;  // -1: no test stall
  double jpeg_test_stall_s = 0;
  bool row_kernels = true;
  bool cudnn_attention = true;
  bool cudnn_tail_mask = true;
  bool gemm_tune = true;
  bool gemm_tune_log = false;
};

// The process's switches, read from the environment on the first call.
const Switches& switches();

// A switch that starts from its Switches field (bool or int) and that a program or test may set at
// run time: the state behind set_accumulate_into_enabled, F::set_dgrad_fusion_enabled,
// cuda::set_pdl_enabled, cuda::set_tail_tma_epilogue_enabled, cuda::set_tail_gemm_mode,
// cuda::set_stem_conv_mode, cuda::set_cudnn_attention_enabled, cuda::set_gemm_tuning_enabled and
// optim::set_grad_overwrite_enabled.
template <typename T>
class RuntimeSetting {
 public:
  explicit constexpr RuntimeSetting(T Switches::*field) : field_(field) {}
  T get() const {
    int v = v_.load(std::memory_order_relaxed);
    if (v == kUnset) {  // first use: the environment's value, unless set() came first
      int expected = kUnset;
      v_.compare_exchange_strong(expected, static_cast<int>(switches().*field_));
      v = v_.load();
    }
    return static_cast<T>(v);
  }
  void set(T value) { v_.store(static_cast<int>(value)); }

 private:
  static constexpr int kUnset = std::numeric_limits<int>::min();
  T Switches::*field_;
  mutable std::atomic<int> v_{kUnset};
};
using RuntimeSwitch = RuntimeSetting<bool>;

}  // namespace kiln
