#include "optim/host_stager.h"

#include <cstring>

#include "core/error.h"

#ifdef KILN_WITH_CUDA
#include "cuda/check.h"
#include "cuda/runtime.h"
#endif

namespace kiln::optim {

struct HostStager::Ring {
  static constexpr int kSlots = 8;
  double* host = nullptr;  // kSlots x count
#ifdef KILN_WITH_CUDA
  cudaEvent_t events[kSlots] = {};
  bool recorded[kSlots] = {};
#endif
  int next = 0;
};

HostStager::HostStager(size_t count) : count_(count), ring_(std::make_unique<Ring>()) {
#ifdef KILN_WITH_CUDA
  if (cuda::device_count() > 0) {
    ring_->host = static_cast<double*>(cuda::alloc_pinned(Ring::kSlots * count * sizeof(double)));
    for (auto& e : ring_->events) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
#endif
}

HostStager::~HostStager() {
#ifdef KILN_WITH_CUDA
  for (auto& e : ring_->events)
    if (e) cudaEventDestroy(e);  // no throw from a destructor
  if (ring_->host) {
    try {
      cuda::free_pinned(ring_->host);
    } catch (const std::exception&) {
    }
  }
#endif
}

void HostStager::stage(const double* values, const Tensor& dst) {
  KILN_CHECK(dst.defined() && dst.dtype() == DType::f64 && dst.numel() == int64_t(count_) &&
                 dst.is_contiguous(),
             "HostStager: the destination must be a contiguous f64 tensor of ", count_,
             " values, got ", dst.defined() ? dst.desc() : "undefined");
  if (dst.is_cpu()) {
    std::memcpy(dst.data<double>(), values, count_ * sizeof(double));
    return;
  }
#ifdef KILN_WITH_CUDA
  KILN_CHECK(ring_->host != nullptr, "HostStager: no CUDA device for ", dst.desc());
  Ring& r = *ring_;
  const int slot = r.next;
  r.next = (r.next + 1) % Ring::kSlots;
  if (r.recorded[slot]) CUDA_CHECK(cudaEventSynchronize(r.events[slot]));
  double* src = r.host + size_t(slot) * count_;
  std::memcpy(src, values, count_ * sizeof(double));
  CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src, count_ * sizeof(double),
                             cudaMemcpyHostToDevice, cuda::current_stream()));
  CUDA_CHECK(cudaEventRecord(r.events[slot], cuda::current_stream()));
  r.recorded[slot] = true;
#endif
}

}  // namespace kiln::optim
