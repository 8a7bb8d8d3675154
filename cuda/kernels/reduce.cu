// Row reductions over contiguous (rows, inner): sum and max, max with index, and the scatter
// that routes a max's gradient back. One warp per row for short rows; one block per row (8 warps
// combined through shared memory) when rows are long.
#include <limits>

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/reduce.cuh"
#include "cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr int64_t kLongRow = 2048;  // from here on a row gets a whole block
constexpr int kWarps = kBlock / 32;

// TPR threads per row: 32 (a warp) or kBlock (the block). Rows are walked grid-stride.
template <int TPR, typename T>
__global__ void reduce_rows_kernel(ReduceOp op, T* out, const T* x, int64_t rows,
                                   int64_t inner) {
  pdl_start();
  using C = acc_t<T>;
  __shared__ C partial[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int t = threadIdx.x % TPR;
  const int64_t rows_per_block = kBlock / TPR;
  const C init = op == ReduceOp::Sum ? C(0) : -std::numeric_limits<C>::infinity();
  for (int64_t r = int64_t(blockIdx.x) * rows_per_block + threadIdx.x / TPR; r < rows;
       r += int64_t(gridDim.x) * rows_per_block) {
    const T* row = x + r * inner;
    C acc = init;
    if (op == ReduceOp::Sum) {
      for (int64_t i = t; i < inner; i += TPR) acc += cvt<C>(row[i]);
      acc = warp_sum(acc);
    } else {
      for (int64_t i = t; i < inner; i += TPR) acc = nan_max(acc, cvt<C>(row[i]));
      acc = warp_max(acc);
    }
    if constexpr (TPR > 32) {
      if (lane == 0) partial[warp] = acc;
      __syncthreads();
      if (warp == 0) {
        acc = lane < kWarps ? partial[lane] : init;
        acc = op == ReduceOp::Sum ? warp_sum(acc) : warp_max(acc);
      }
      __syncthreads();  // partial is rewritten by the next row
    }
    if (t == 0) out[r] = cvt<T>(acc);
  }
}

template <int TPR, typename T>
__global__ void max_rows_kernel(T* values, int64_t* indices, const T* x, int64_t rows,
                                int64_t inner) {
  pdl_start();
  using C = acc_t<T>;
  __shared__ C pv[kWarps];
  __shared__ int64_t pi[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int t = threadIdx.x % TPR;
  const int64_t rows_per_block = kBlock / TPR;
  const C ninf = -std::numeric_limits<C>::infinity();
  const int64_t none = std::numeric_limits<int64_t>::max();
  for (int64_t r = int64_t(blockIdx.x) * rows_per_block + threadIdx.x / TPR; r < rows;
       r += int64_t(gridDim.x) * rows_per_block) {
    const T* row = x + r * inner;
    C v = ninf;
    int64_t idx = none;
    for (int64_t i = t; i < inner; i += TPR) {
      const C c = cvt<C>(row[i]);
      if (arg_better(c, i, v, idx)) {
        v = c;
        idx = i;
      }
    }
    warp_argmax(v, idx);
    if constexpr (TPR > 32) {
      if (lane == 0) {
        pv[warp] = v;
        pi[warp] = idx;
      }
      __syncthreads();
      if (warp == 0) {
        v = lane < kWarps ? pv[lane] : ninf;
        idx = lane < kWarps ? pi[lane] : none;
        warp_argmax(v, idx);
      }
      __syncthreads();
    }
    if (t == 0) {
      values[r] = cvt<T>(v);
      indices[r] = idx;
    }
  }
}

template <typename T>
__global__ void scatter_rows_kernel(T* dx, const T* g, const int64_t* indices, int64_t rows,
                                    int64_t inner) {
  pdl_start();
  const int64_t n = rows * inner;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / inner, c = i - r * inner;
    dx[i] = c == indices[r] ? g[r] : cvt<T>(0.0f);
  }
}

// Column sums of contiguous x (outer, cols), pass 1: block (chunk, tile) sums rows
// [chunk·rows_per_chunk, ...) of the tile's `width` columns into partial[chunk, col], f32. The
// block's threads are `groups` row groups of `width` lanes (one column each); group g takes rows
// g, g + groups, ... of the chunk, so each step reads groups·width consecutive elements; the
// groups' sums are then added in group order.
template <typename T>
__global__ void col_partials_kernel(float* __restrict__ partial, const T* __restrict__ x,
                                    int64_t outer, int64_t cols, int64_t rows_per_chunk,
                                    int width) {
  pdl_start();
  __shared__ float part[kBlock];
  const int groups = kBlock / width;
  const int lane = threadIdx.x % width, group = threadIdx.x / width;
  const int64_t col = int64_t(blockIdx.y) * width + lane;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_chunk;
  const int64_t r1 = min(outer, r0 + rows_per_chunk);
  float acc = 0.f;
  if (group < groups && col < cols)
    for (int64_t r = r0 + group; r < r1; r += groups) acc += cvt<float>(x[r * cols + col]);
  part[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x < width && col < cols) {
    float s = 0.f;
    for (int g = 0; g < groups; ++g) s += part[g * width + threadIdx.x];
    partial[int64_t(blockIdx.x) * cols + col] = s;
  }
}

// Pass 2: out[col] = Σ over chunks of partial[chunk, col], one block per column: each thread
// sums a strided share of the chunks, then the warps' sums are combined in a fixed order.
template <typename T>
__global__ void col_finish_kernel(T* __restrict__ out, const float* __restrict__ partial,
                                  int64_t chunks, int64_t cols) {
  pdl_start();
  __shared__ float warps[kWarps];
  const int64_t col = blockIdx.x;
  float acc = 0.f;
  for (int64_t k = threadIdx.x; k < chunks; k += kBlock) acc += partial[k * cols + col];
  acc = warp_sum(acc);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int w = 0; w < kWarps; ++w) s += warps[w];
    out[col] = cvt<T>(s);
  }
}

// Grid for a row kernel with TPR threads per row.
unsigned row_grid(int64_t rows, int tpr) {
  const int64_t rows_per_block = kBlock / tpr;
  return grid_for((rows + rows_per_block - 1) / rows_per_block * kBlock);
}

}  // namespace

void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& x, int64_t rows, int64_t inner) {
  if (rows == 0) return;
  dispatch_device_float(x.dtype(), "reduce", [&]<typename T>() {
    T* o = static_cast<T*>(out.raw_data());
    const T* p = static_cast<const T*>(x.raw_data());
    cudaStream_t s = current_stream();
    if (inner >= kLongRow)
      launch(reduce_rows_kernel<kBlock, T>, row_grid(rows, kBlock), kBlock, 0, s, op, o, p, rows,
             inner);
    else
      launch(reduce_rows_kernel<32, T>, row_grid(rows, 32), kBlock, 0, s, op, o, p, rows, inner);
    KILN_CUDA_CHECK_LAUNCH();
  });
}

void reduce_cols(const Tensor& out, const Tensor& x, int64_t outer, int64_t cols) {
  if (cols == 0) return;
  // Chunks of rows: enough blocks to fill the GPU several times over, each reading at least a
  // few thousand elements; at most 4096 partial rows.
  const int width = int(std::min<int64_t>(cols, kBlock));
  const int64_t tiles = (cols + width - 1) / width;
  const int64_t want_chunks = std::max<int64_t>(1, std::min<int64_t>(4096 / tiles + 1, 1024));
  const int64_t rows_per_chunk =
      std::max<int64_t>((outer + want_chunks - 1) / want_chunks, std::max<int64_t>(1, 4096 / cols));
  const int64_t chunks = std::max<int64_t>(1, (outer + rows_per_chunk - 1) / rows_per_chunk);
  Tensor partial = empty({chunks, cols}, TensorOptions(DType::f32).with_device(x.device()));
  dispatch_device_float(x.dtype(), "reduce", [&]<typename T>() {
    cudaStream_t s = current_stream();
    launch(col_partials_kernel<T>, dim3(unsigned(chunks), unsigned(tiles)), kBlock, 0, s,
           static_cast<float*>(partial.raw_data()), static_cast<const T*>(x.raw_data()), outer,
           cols, rows_per_chunk, width);
    KILN_CUDA_CHECK_LAUNCH();
    launch(col_finish_kernel<T>, unsigned(cols), kBlock, 0, s, static_cast<T*>(out.raw_data()),
           static_cast<const float*>(partial.raw_data()), chunks, cols);
    KILN_CUDA_CHECK_LAUNCH();
  });
}

void max_rows(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t rows,
              int64_t inner) {
  if (rows == 0) return;
  dispatch_device_float(x.dtype(), "max", [&]<typename T>() {
    T* v = static_cast<T*>(values.raw_data());
    int64_t* ix = static_cast<int64_t*>(indices.raw_data());
    const T* p = static_cast<const T*>(x.raw_data());
    cudaStream_t s = current_stream();
    if (inner >= kLongRow)
      launch(max_rows_kernel<kBlock, T>, row_grid(rows, kBlock), kBlock, 0, s, v, ix, p, rows,
             inner);
    else
      launch(max_rows_kernel<32, T>, row_grid(rows, 32), kBlock, 0, s, v, ix, p, rows, inner);
    KILN_CUDA_CHECK_LAUNCH();
  });
}

void scatter_rows(const Tensor& dx, const Tensor& g, const Tensor& indices, int64_t rows,
                  int64_t inner) {
  const int64_t n = rows * inner;
  if (n == 0) return;
  dispatch_device_float(dx.dtype(), "max backward", [&]<typename T>() {
    launch(scatter_rows_kernel<T>, grid_for(n), kBlock, 0, current_stream(),
           static_cast<T*>(dx.raw_data()), static_cast<const T*>(g.raw_data()),
           static_cast<const int64_t*>(indices.raw_data()), rows, inner);
    KILN_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace kiln::cuda
