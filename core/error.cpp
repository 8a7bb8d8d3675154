#include "core/error.h"

#include <cstring>
#include <sstream>

namespace kiln::detail {

[[noreturn]] void fail(ErrorKind kind, const char* file, int line, const char* expr,
                       const std::string& msg) {
  // Show the path from the repository root only: "ops/conv2d.cpp:42". C++ files are compiled
  // with a prefix map that already does this; for the rest (CUDA), cut at the right-most
  // top-level folder name, so a checkout under /x/data/ or /y/tests/ is still cut correctly.
  const char* short_file = file;
  for (const char* dir : {"/core/", "/ops/", "/cuda/", "/models/", "/optim/", "/data/", "/tools/",
                          "/tests/"}) {
    for (const char* p = std::strstr(file, dir); p; p = std::strstr(p + 1, dir))
      if (p + 1 > short_file) short_file = p + 1;
  }
  std::ostringstream os;
  os << msg << " [" << short_file << ":" << line;
  if (expr) os << ", check failed: " << expr;
  os << "]";
  const std::string what = os.str();
  switch (kind) {
    case ErrorKind::Generic: throw Error(what);
    case ErrorKind::Cuda: throw CudaError(what);
    case ErrorKind::Cudnn: throw CudnnError(what);
    case ErrorKind::Cublas: throw CublasError(what);
    case ErrorKind::Nccl: throw NcclError(what);
    case ErrorKind::OutOfMemory: throw OutOfMemoryError(what);
  }
  throw Error(what);
}

}  // namespace kiln::detail
