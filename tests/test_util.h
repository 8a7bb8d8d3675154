#pragma once
// Helpers shared by the test suites.
#include <omp.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace kiln::testing {

// The message of the kiln::Error that fn throws ("" when it throws none). Any other exception
// passes through, and the test case fails on it.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// What fn returns when OpenMP runs it on `threads` threads; the thread count is restored after.
template <typename Fn>
auto on_threads(int threads, Fn&& fn) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  struct Restore {
    int n;
    ~Restore() { omp_set_num_threads(n); }
  } restore{before};
  return std::forward<Fn>(fn)();
}

// Whether two tensors hold the same dtype, shape and bytes.
inline bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return ca.dtype() == cb.dtype() && ca.shape() == cb.shape() &&
         std::memcmp(ca.raw_data(), cb.raw_data(), ca.nbytes()) == 0;
}

}  // namespace kiln::testing
