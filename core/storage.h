#pragma once
// Storage: one block of memory on one device, obtained from an Allocator. Tensors that view
// the same storage share its version counter, which in-place ops bump so autograd can detect
// a saved tensor that was modified after it was saved.
#include <atomic>
#include <cstddef>
#include <memory>

#include "core/dtype.h"

namespace kiln {

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns at least `nbytes` bytes (nbytes may be 0). Throws OutOfMemoryError on failure.
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
};

// 64-byte aligned host memory.
Allocator* cpu_allocator();
// The device's caching allocator (cuda/allocator.cpp); an error when built without CUDA.
Allocator* allocator_for(Device device);

class Storage {
 public:
  Storage(size_t nbytes, Device device);
  // Wraps memory owned elsewhere (no deallocation).
  Storage(void* external, size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  Allocator* allocator_ = nullptr;  // null for external memory
  std::atomic<uint64_t> version_{0};
};

}  // namespace kiln
