// kiln's one error family (core/error.h): detail::fail throws the class its ErrorKind names,
// every one of them a kiln::Error, with the message, file:line and the failed expression.
#include <doctest/doctest.h>

#include <string>
#include <typeindex>
#include <typeinfo>
#include <vector>

#include "core/error.h"
#include "tests/test_util.h"

using namespace kiln;
using kiln::testing::error_of;

namespace {

[[noreturn]] void fail_as(ErrorKind kind) {
  detail::fail(kind, "/checkout/cuda/nccl.cpp", 42, "ncclAllReduce(...)", "NCCL error unhandled");
}

// The dynamic class of the kiln::Error that fail_as(kind) throws.
std::type_index thrown_class(ErrorKind kind) {
  try {
    fail_as(kind);
  } catch (const Error& e) {
    return typeid(e);
  }
}

}  // namespace

TEST_CASE("ErrorKind::Nccl throws NcclError, a kiln::Error") {
  CHECK_THROWS_AS(fail_as(ErrorKind::Nccl), NcclError);
  CHECK_THROWS_AS(fail_as(ErrorKind::Nccl), Error);
  CHECK(thrown_class(ErrorKind::Nccl) == typeid(NcclError));
  CHECK(error_of([] { fail_as(ErrorKind::Nccl); }) ==
        "NCCL error unhandled [cuda/nccl.cpp:42, check failed: ncclAllReduce(...)]");
}

TEST_CASE("every ErrorKind throws its own class") {
  CHECK(thrown_class(ErrorKind::Generic) == typeid(Error));
  CHECK(thrown_class(ErrorKind::Cuda) == typeid(CudaError));
  CHECK(thrown_class(ErrorKind::Cudnn) == typeid(CudnnError));
  CHECK(thrown_class(ErrorKind::Cublas) == typeid(CublasError));
  CHECK(thrown_class(ErrorKind::Nccl) == typeid(NcclError));
  CHECK(thrown_class(ErrorKind::OutOfMemory) == typeid(OutOfMemoryError));
  CHECK(thrown_class(ErrorKind::Io) == typeid(IoError));
}

TEST_CASE("IoError's message is complete: no location, no expression") {
  CHECK(error_of([] {
          detail::fail(ErrorKind::Io, "/checkout/core/serialization.cpp", 57, "fd >= 0",
                       "cannot create 'x': Read-only file system");
        }) == "cannot create 'x': Read-only file system");
  const bool disk_full = true;
  CHECK_THROWS_AS([&] { KILN_IO_CHECK(!disk_full, "writing 'y' failed"); }(), IoError);
}

TEST_CASE("strip_location drops every location detail::fail adds, and nothing else") {
  // A real one: the message comes back as it was, brackets of its own included.
  const std::vector<int> v{1, 2};
  const std::string what = error_of([&] { KILN_CHECK(v[0] == 2, "values [1, 2] of 'a.b:3'"); });
  CHECK(what.rfind("values [1, 2] of 'a.b:3' [", 0) == 0);
  CHECK(what.find(", check failed: v[0] == 2]") != std::string::npos);
  CHECK(strip_location(what) == "values [1, 2] of 'a.b:3'");
  // A message that wraps another's what(): both locations go, wherever they stand; brackets
  // nested inside a failed expression go with it.
  CHECK(strip_location("outer [tools/a-b.cpp:12]: inner [ops/index.cpp:7, check failed: "
                       "p[i[0]] >= 0 && p[i[0]] < n]; the end") == "outer: inner; the end");
  // Brackets that are not a location stay (one is a file name with a dot, ':', digits, then ']'
  // or ", check failed: ...]").
  for (const char* kept : {"shape [2, 3]", "time [12:30]", "version [v1.2]", "file [a.cpp:] empty",
                           "line [a.cpp:12x]", "open [a.cpp:1, unclosed", "", "plain"})
    CHECK(strip_location(kept) == kept);
}
