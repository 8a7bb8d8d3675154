// Compiled only when CMake found NCCL (KILN_WITH_NCCL); the file is empty otherwise.
#ifdef KILN_WITH_NCCL
#include "cuda/nccl.h"

#include <cstring>
#include <unordered_set>

#include "core/autograd.h"
#include "cuda/check.h"
#include "cuda/runtime.h"

// As CUDA_CHECK (cuda/check.h), for NCCL: throws NcclError with NCCL's last error message.
#define NCCL_CHECK(expr)                                                            \
  do {                                                                              \
    ncclResult_t _r = (expr);                                                       \
    if (_r != ncclSuccess) [[unlikely]] {                                           \
      const char* _last = ncclGetLastError(nullptr);                                \
      ::kiln::detail::fail(                                                         \
          ::kiln::ErrorKind::Nccl, __FILE__, __LINE__, #expr,                       \
          ::kiln::detail::str_cat("NCCL error ", ncclGetErrorString(_r),            \
                                  _last&&* _last ? ": " : "", _last ? _last : "")); \
    }                                                                               \
  } while (0)

namespace kiln::cuda {
namespace {

ncclDataType_t nccl_type(DType t, const char* op) {
  switch (t) {
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
    default:
      KILN_FAIL(op, ": NCCL cannot reduce dtype ", dtype_name(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
  }
  KILN_FAIL("unknown ReduceOp");
}

// Dense: the elements fill [raw_data, raw_data + nbytes) in some order, so a flat byte copy or
// a flat NCCL call covers exactly the tensor.
bool is_dense(const Tensor& t) {
  return t.is_contiguous() || (t.dim() == 4 && t.is_contiguous(MemoryFormat::ChannelsLast));
}

// Sets the device for a scope (NCCL calls act on the current device).
class DeviceScope {
 public:
  explicit DeviceScope(int device) : prev_(current_device()) {
    if (prev_ != device) set_device(device);
  }
  ~DeviceScope() {
    if (prev_ != current_device()) cudaSetDevice(prev_);  // best effort in a destructor
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_;
};

}  // namespace

// ---------------- Communicator ----------------

std::vector<uint8_t> Communicator::make_unique_id() {
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<uint8_t> blob(sizeof(id));
  std::memcpy(blob.data(), &id, sizeof(id));
  return blob;
}

Communicator::Communicator(const std::vector<uint8_t>& unique_id, int rank, int world_size, int device)
    : rank_(rank), world_size_(world_size), device_(device) {
  ncclUniqueId id;
  KILN_CHECK(unique_id.size() == sizeof(id), "Communicator: the unique id has ", unique_id.size(),
             " bytes, NCCL's has ", sizeof(id));
  KILN_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "Communicator: rank ", rank,
             " is out of range for world size ", world_size);
  KILN_CHECK(device >= 0 && device < device_count(), "Communicator: device ", device,
             " does not exist (", device_count(), " visible)");
  std::memcpy(&id, unique_id.data(), sizeof(id));
  DeviceScope scope(device);
  NCCL_CHECK(ncclCommInitRank(&comm_, world_size, id, rank));
}

Communicator::~Communicator() {
  if (comm_) {
    DeviceScope scope(device_);
    ncclCommDestroy(comm_);  // a destructor does not throw; the comm is gone either way
  }
}

void Communicator::check_tensor(const Tensor& t, const char* op) const {
  KILN_CHECK(t.defined(), op, ": undefined tensor");
  KILN_CHECK(t.is_cuda() && t.device().index == device_, op, ": tensor ", t.desc(),
             " is not on this communicator's device cuda:", device_);
  KILN_CHECK(is_dense(t), op, ": tensor ", t.desc(), " of shape ", t.shape_str(),
             " is not dense (contiguous or channels-last); call .contiguous() first");
  nccl_type(t.dtype(), op);
}

void Communicator::all_reduce(const Tensor& t, ReduceOp op, cudaStream_t stream) {
  check_tensor(t, "all_reduce");
  KILN_CHECK(op != ReduceOp::Avg || is_floating(t.dtype()),
             "all_reduce: Avg needs a floating dtype, got ", t.desc());
  DeviceScope scope(device_);
  void* p = t.raw_data();
  NCCL_CHECK(ncclAllReduce(p, p, size_t(t.numel()), nccl_type(t.dtype(), "all_reduce"), nccl_op(op),
                           comm_, stream ? stream : current_stream()));
  t.bump_version();
}

void Communicator::broadcast(const Tensor& t, int root, cudaStream_t stream) {
  broadcast(std::vector<Tensor>{t}, root, stream);
}

void Communicator::broadcast(const std::vector<Tensor>& ts, int root, cudaStream_t stream) {
  KILN_CHECK(root >= 0 && root < world_size_, "broadcast: root ", root,
             " is out of range for world size ", world_size_);
  for (const Tensor& t : ts) check_tensor(t, "broadcast");
  DeviceScope scope(device_);
  cudaStream_t s = stream ? stream : current_stream();
  NCCL_CHECK(ncclGroupStart());
  for (const Tensor& t : ts) {
    void* p = t.raw_data();
    const ncclResult_t r =
        ncclBroadcast(p, p, size_t(t.numel()), nccl_type(t.dtype(), "broadcast"), root, comm_, s);
    if (r != ncclSuccess) {
      ncclGroupEnd();
      NCCL_CHECK(r);
    }
  }
  NCCL_CHECK(ncclGroupEnd());
  for (const Tensor& t : ts) t.bump_version();
}

void Communicator::broadcast(const std::vector<std::pair<std::string, Tensor>>& named, int root) {
  std::vector<Tensor> ts;
  for (const auto& [name, t] : named) ts.push_back(t);
  broadcast(ts, root);
}

// ---------------- GradBucketer ----------------

GradBucketer::GradBucketer(Communicator& comm, std::vector<Tensor> params, BucketOptions opts)
    : comm_(comm), params_(std::move(params)), opts_(opts) {
  KILN_CHECK(opts.bucket_bytes > 0, "GradBucketer: bucket_bytes must be > 0");
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    KILN_CHECK(p.defined() && p.is_leaf() && p.requires_grad(), "GradBucketer: parameter ", i,
               " is not a leaf that requires grad");
    KILN_CHECK(p.is_cuda() && p.device().index == comm.device(), "GradBucketer: parameter ", i, " ",
               p.desc(), " is not on the communicator's device cuda:", comm.device());
    KILN_CHECK(is_floating(p.dtype()), "GradBucketer: parameter ", i, " has dtype ",
               dtype_name(p.dtype()));
    KILN_CHECK(seen.insert(p.impl_ptr().get()).second, "GradBucketer: parameter ", i,
               " is listed twice");
  }
  DeviceScope scope(comm.device());
  // Reverse registration order; an open bucket per dtype, closed once it reaches bucket_bytes.
  bucket_of_.assign(params_.size(), 0);
  std::vector<std::pair<DType, size_t>> open;  // dtype -> index of its open bucket
  for (size_t k = params_.size(); k-- > 0;) {
    const Tensor& p = params_[k];
    size_t b = SIZE_MAX;
    for (auto& [dt, idx] : open)
      if (dt == p.dtype()) b = idx;
    if (b == SIZE_MAX) {
      buckets_.emplace_back();
      buckets_.back().dtype = p.dtype();
      b = buckets_.size() - 1;
      open.emplace_back(p.dtype(), b);
    }
    Bucket& bk = buckets_[b];
    bk.slots.push_back({k, bk.numel});
    bk.numel += p.numel();
    bucket_of_[k] = b;
    if (size_t(bk.numel) * dtype_size(bk.dtype) >= opts.bucket_bytes)
      std::erase_if(open, [b](const auto& o) { return o.second == b; });
  }
  const Device dev = Device::cuda(comm.device());
  for (Bucket& b : buckets_) {
    b.buffer = empty({b.numel}, TensorOptions(b.dtype).with_device(dev));
    b.pending = b.slots.size();
    CUDA_CHECK(cudaEventCreateWithFlags(&b.ready, cudaEventDisableTiming));
  }
  CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  ready_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i)
    hook_ids_.push_back(
        autograd::add_post_accumulate_grad_hook(params_[i], [this, i](const Tensor&) {
          if (sync_) mark_ready(i);
        }));
}

GradBucketer::~GradBucketer() {
  for (size_t i = 0; i < hook_ids_.size(); ++i)
    autograd::remove_post_accumulate_grad_hook(params_[i], hook_ids_[i]);
  // The buffers go back to the caching allocator: the all-reduces reading them must be done.
  if (comm_stream_) cudaStreamSynchronize(comm_stream_);
  for (Bucket& b : buckets_)
    if (b.ready) cudaEventDestroy(b.ready);
  if (done_) cudaEventDestroy(done_);
  if (comm_stream_) cudaStreamDestroy(comm_stream_);
}

std::vector<std::vector<size_t>> GradBucketer::bucket_layout() const {
  std::vector<std::vector<size_t>> out;
  for (const Bucket& b : buckets_) {
    out.emplace_back();
    for (const Slot& s : b.slots) out.back().push_back(s.param);
  }
  return out;
}

void GradBucketer::mark_ready(size_t i) {
  KILN_CHECK(i < params_.size(), "GradBucketer::mark_ready: index ", i, " out of range");
  Bucket& b = buckets_[bucket_of_[i]];
  if (ready_[i]) {
    KILN_CHECK(!b.launched, "GradBucketer: parameter ", i,
               " received another gradient after its bucket's all-reduce started; call finish() "
               "after each backward, or set_sync(false) for accumulation micro-steps");
    return;
  }
  ready_[i] = 1;
  if (--b.pending == 0) launch_in_order();
}

void GradBucketer::launch_in_order() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0)
    launch(buckets_[next_launch_++]);
}

void GradBucketer::launch(Bucket& b) {
  DeviceScope scope(comm_.device());
  cudaStream_t s = current_stream();
  const size_t esize = dtype_size(b.dtype);
  for (const Slot& slot : b.slots) {
    const Tensor& p = params_[slot.param];
    const Tensor g = p.grad();
    char* dst = static_cast<char*>(b.buffer.raw_data()) + size_t(slot.offset) * esize;
    if (!g.defined()) {
      CUDA_CHECK(cudaMemsetAsync(dst, 0, size_t(p.numel()) * esize, s));
    } else if (is_dense(g) && g.dtype() == b.dtype && g.is_cuda()) {
      CUDA_CHECK(cudaMemcpyAsync(dst, g.raw_data(), g.nbytes(), cudaMemcpyDeviceToDevice, s));
    } else {
      b.buffer.narrow(0, slot.offset, p.numel()).view(p.shape()).copy_(g);
    }
  }
  CUDA_CHECK(cudaEventRecord(b.ready, s));
  CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, b.ready, 0));
  void* buf = b.buffer.raw_data();
  NCCL_CHECK(ncclAllReduce(buf, buf, size_t(b.numel), nccl_type(b.dtype, "GradBucketer"),
                           opts_.average ? ncclAvg : ncclSum, comm_.get(), comm_stream_));
  b.launched = true;
}

void GradBucketer::finish() {
  for (Bucket& b : buckets_) b.pending = 0;  // missing gradients count as zeros
  launch_in_order();
  DeviceScope scope(comm_.device());
  cudaStream_t s = current_stream();
  CUDA_CHECK(cudaEventRecord(done_, comm_stream_));
  CUDA_CHECK(cudaStreamWaitEvent(s, done_, 0));
  NoGradGuard no_grad;
  for (Bucket& b : buckets_) {
    const size_t esize = dtype_size(b.dtype);
    for (const Slot& slot : b.slots) {
      const Tensor& p = params_[slot.param];
      Tensor g = p.grad();
      const char* src = static_cast<const char*>(b.buffer.raw_data()) + size_t(slot.offset) * esize;
      if (!g.defined()) {
        g = empty(p.shape(), TensorOptions(b.dtype)
                                 .with_device(p.device())
                                 .with_memory_format(p.suggest_memory_format()));
        p.set_grad(g);
      }
      if (is_dense(g) && g.dtype() == b.dtype && g.is_cuda()) {
        CUDA_CHECK(cudaMemcpyAsync(g.raw_data(), src, g.nbytes(), cudaMemcpyDeviceToDevice, s));
        g.bump_version();
      } else {
        g.copy_(b.buffer.narrow(0, slot.offset, p.numel()).view(p.shape()));
      }
    }
    b.pending = b.slots.size();
    b.launched = false;
  }
  std::fill(ready_.begin(), ready_.end(), uint8_t(0));
  next_launch_ = 0;
}

}  // namespace kiln::cuda
#endif  // KILN_WITH_NCCL
