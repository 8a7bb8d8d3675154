#pragma once
// Helpers shared by the test suites.
#include <string>
#include <utility>

#include "core/error.h"

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

}  // namespace kiln::testing
