#pragma once
// Data-parallel collectives on NCCL (built only with KILN_WITH_NCCL): a communicator per process
// and GPU, in-place all-reduce and broadcast of device tensors, and GradBucketer, which averages
// gradients across ranks in buckets launched while backward is still running (PyTorch DDP's
// scheme).
//
//   DistEnv env = DistEnv::from_env();
//   cuda::set_device(env.local_rank);
//   Rendezvous rv(env);                                  // tools/train/rendezvous.h
//   auto comm = train::join_communicator(rv, env.local_rank);  // ncclUniqueId shared through rv
//   comm.broadcast(model->state());                       // same start on every rank
//   cuda::GradBucketer ddp(comm, model->parameters());
//   ... loss.backward();        // buckets' all-reduces start as their gradients complete
//   ddp.finish();               // current stream waits; .grad now holds the rank average
//   comm.agree_found_inf(found_inf);   // all ranks skip the step together
//   opt.step();
//
// Streams: every operation is enqueued on kiln::cuda::current_stream() (or, for the bucketer's
// all-reduces, on its own communication stream joined to the current stream by events) and
// never synchronises the host, so a step using them can be captured into a CUDA graph
// (cuda/graph.h); NCCL collectives are capturable. All ranks must issue the same collectives in
// the same order with the same sizes; a rank that does not will hang the others inside NCCL
// (the launcher, tools/train/launcher.h, kills the siblings of a rank that dies).
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <vector>

#include "core/kinds.h"
#include "core/tensor.h"

namespace kiln::cuda {

class Communicator {
 public:
  // Joins the communicator of world_size ranks on `device` (blocking until all have joined),
  // from an id made by make_unique_id() on one rank and shared with the others by the caller
  // (tools/train/train_dist.h: join_communicator does it through a Rendezvous).
  Communicator(const std::vector<uint8_t>& unique_id, int rank, int world_size, int device);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  static std::vector<uint8_t> make_unique_id();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }
  ncclComm_t get() const { return comm_; }

  // In place on every rank: t = op over ranks of t. `t` lives on this communicator's device, is
  // dense (contiguous or channels-last) and of a dtype NCCL reduces (f16, bf16, f32, f64, i32,
  // i64, u8); Avg needs a floating dtype. On `stream` (default: the current stream).
  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum, cudaStream_t stream = nullptr);
  // In place: every rank's t = root's t.
  void broadcast(const Tensor& t, int root = 0, cudaStream_t stream = nullptr);
  // Broadcasts many tensors in one NCCL group (parameters and buffers at start-up).
  void broadcast(const std::vector<Tensor>& ts, int root = 0, cudaStream_t stream = nullptr);
  // Named-tensor form: broadcasts the tensors of Module::state().
  void broadcast(const std::vector<std::pair<std::string, Tensor>>& named, int root = 0);
  // found_inf = max over ranks (a one-element device flag, any NCCL dtype): when any rank saw a
  // non-finite gradient, every rank sees it and skips the step.
  void agree_found_inf(const Tensor& found_inf) { all_reduce(found_inf, ReduceOp::Max); }

 private:
  void check_tensor(const Tensor& t, const char* op) const;
  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int world_size_ = 1;
  int device_ = 0;
};

struct BucketOptions {
  size_t bucket_bytes = size_t(25) << 20;  // a bucket closes once it holds at least this much
  bool average = true;                     // divide the sum by the world size
};

// Gradient all-reduce in buckets, overlapped with backward.
//
// Buckets: the parameters, in reverse registration order (roughly the order backward finishes
// their gradients), are cut into runs of about `bucket_bytes`, one dtype per bucket (FP16
// parameters give FP16 buckets, FP32 ones FP32 buckets: the reduction runs in the gradient's own
// precision). Each bucket owns a flat device buffer.
//
// Per step: a post-accumulate-grad hook (core/autograd.h) on every parameter marks it ready.
// When all parameters of a bucket are ready and all earlier buckets have been launched (so every
// rank launches in the same order), the bucket's gradients are copied into its buffer on the
// current stream, an event is recorded there, and the communication stream waits on it and runs
// the all-reduce (ncclAvg, or ncclSum without `average`). finish() launches the buckets still
// pending (a parameter without a gradient contributes zeros), makes the current stream wait for
// all all-reduces, and copies the results back into each .grad (`=`; a parameter that had no
// gradient gets one). Then the bucketer is ready for the next step.
//
// Contracts: call finish() once after each backward and before the optimizer reads .grad; with
// sync off (set_sync(false), for gradient-accumulation micro-steps: DDP's no_sync) the hooks do
// nothing and finish() must not be called. A parameter reached by a second backward after its
// bucket was launched is an error. Parameters must not change dtype, device or shape while the
// bucketer lives. No host synchronisation: capturable into a CUDA graph (the events and the
// stream are created at construction, the buffers too).
class GradBucketer {
 public:
  // params: CUDA tensors on comm's device that require grad, in registration order
  // (Module::parameters()). Duplicates are an error.
  GradBucketer(Communicator& comm, std::vector<Tensor> params, BucketOptions opts = {});
  ~GradBucketer();  // removes the hooks; waits for the communication stream
  GradBucketer(const GradBucketer&) = delete;
  GradBucketer& operator=(const GradBucketer&) = delete;

  // Marks parameter i (index into params) ready; the hooks call it.
  void mark_ready(size_t i);
  void finish();
  void set_sync(bool on) { sync_ = on; }
  bool sync() const { return sync_; }

  size_t num_buckets() const { return buckets_.size(); }
  // Parameter indices of each bucket, in bucket order.
  std::vector<std::vector<size_t>> bucket_layout() const;
  cudaStream_t comm_stream() const { return comm_stream_; }

 private:
  struct Slot {
    size_t param = 0;
    int64_t offset = 0;  // in elements, within the bucket buffer
  };
  struct Bucket {
    DType dtype = DType::f32;
    std::vector<Slot> slots;
    int64_t numel = 0;
    Tensor buffer;  // flat, dtype, on the device
    cudaEvent_t ready = nullptr;
    size_t pending = 0;
    bool launched = false;
  };
  void launch(Bucket& b);
  void launch_in_order();

  Communicator& comm_;
  std::vector<Tensor> params_;
  BucketOptions opts_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // param -> bucket
  std::vector<uint8_t> ready_;     // param marked in this step
  std::vector<uint64_t> hook_ids_;
  size_t next_launch_ = 0;
  bool sync_ = true;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

}  // namespace kiln::cuda
