#include "core/storage.h"

#include "core/backend.h"

#include <cstdlib>

namespace kiln {
namespace {

class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    size_t rounded = (nbytes + 63) / 64 * 64;
    if (rounded == 0) rounded = 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) {
      ::kiln::detail::fail(ErrorKind::OutOfMemory, __FILE__, __LINE__, nullptr,
                           detail::str_cat("out of host memory allocating ", nbytes, " bytes"));
    }
    return p;
  }
  void deallocate(void* ptr, size_t) override { std::free(ptr); }
};

}  // namespace

Allocator* cpu_allocator() {
  static CpuAllocator a;
  return &a;
}

Allocator* allocator_for(Device device) {
  if (device.is_cpu()) return cpu_allocator();
  return backend(device).allocator(device.index);
}

Storage::Storage(size_t nbytes, Device device)
    : nbytes_(nbytes), device_(device), allocator_(allocator_for(device)) {
  data_ = allocator_->allocate(nbytes);
}

Storage::Storage(void* external, size_t nbytes, Device device)
    : data_(external), nbytes_(nbytes), device_(device) {}

Storage::~Storage() {
  if (allocator_ && data_) allocator_->deallocate(data_, nbytes_);
}

}  // namespace kiln
