#include "core/error.h"

#include <cctype>
#include <cstring>
#include <sstream>

namespace kiln {

namespace {

// The length of a location "[dir/file.ext:123" or "[dir/file.ext:123, check failed: ...]"
// starting at what[at] == '[' (brackets inside the expression nest), else 0.
size_t location_length(const std::string& what, size_t at) {
  size_t i = at + 1;
  bool dot = false;
  while (i < what.size() && (std::isalnum(static_cast<unsigned char>(what[i])) ||
                             what[i] == '_' || what[i] == '/' || what[i] == '.' || what[i] == '-')) {
    dot |= what[i] == '.';
    ++i;
  }
  if (!dot || i == at + 1 || i + 1 >= what.size() || what[i] != ':' ||
      !std::isdigit(static_cast<unsigned char>(what[i + 1])))
    return 0;
  ++i;
  while (i < what.size() && std::isdigit(static_cast<unsigned char>(what[i]))) ++i;
  if (i < what.size() && what[i] == ']') return i + 1 - at;
  if (what.compare(i, 16, ", check failed: ") != 0) return 0;
  int depth = 1;
  for (; i < what.size(); ++i) {
    if (what[i] == '[') ++depth;
    if (what[i] == ']' && --depth == 0) return i + 1 - at;
  }
  return 0;
}

}  // namespace

std::string strip_location(const std::string& what) {
  std::string out;
  size_t from = 0;
  for (size_t at = what.find(" [", from); at != std::string::npos; at = what.find(" [", at + 1)) {
    const size_t n = location_length(what, at + 1);
    if (n == 0) continue;
    out.append(what, from, at - from);
    from = at + 1 + n;
    at = from - 1;
  }
  out.append(what, from, std::string::npos);
  return out;
}

}  // namespace kiln

namespace kiln::detail {

[[noreturn]] void fail(ErrorKind kind, const char* file, int line, const char* expr,
                       const std::string& msg) {
  if (kind == ErrorKind::Io) throw IoError(msg);  // complete as it is (core/error.h)
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
    case ErrorKind::Io: break;
  }
  throw Error(what);
}

}  // namespace kiln::detail
