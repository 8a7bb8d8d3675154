#include "core/error.h"

#include <cstring>

namespace kiln::detail {

[[noreturn]] void fail(ErrorKind kind, const char* file, int line, const char* expr,
                       const std::string& msg) {
  // Show the path from the repository root only: "ops/conv2d.cpp:42".
  const char* short_file = file;
  for (const char* dir : {"/core/", "/ops/", "/cuda/", "/models/", "/optim/", "/data/", "/tools/",
                          "/tests/"}) {
    if (const char* p = std::strstr(file, dir)) {
      short_file = p + 1;
      break;
    }
  }
  std::string what = msg;
  what += " [";
  what += short_file;
  what += ":" + std::to_string(line);
  if (expr) {
    what += ", check failed: ";
    what += expr;
  }
  what += "]";
  switch (kind) {
    case ErrorKind::Generic: throw Error(what);
    case ErrorKind::Cuda: throw CudaError(what);
    case ErrorKind::Cudnn: throw CudnnError(what);
    case ErrorKind::Cublas: throw CublasError(what);
    case ErrorKind::OutOfMemory: throw OutOfMemoryError(what);
  }
  throw Error(what);
}

}  // namespace kiln::detail
