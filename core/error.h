#pragma once
// kiln's one error family. Every failed check throws kiln::Error (or a subclass for a CUDA
// library) through kiln::detail::fail, which records file:line, the failed expression and a
// message built from the remaining arguments. Tools catch at main and exit non-zero.
//
//   KILN_CHECK(x.dim() == 4, "conv2d: input must be 4-D, got ", x.shape_str());
//   KILN_FAIL("unknown flag ", name);
//
// IoError is the one without a location: the operating system refused an operation on a file
// the message names (a full disk, a read-only folder, a missing parent), which is the user's to
// fix, not a bug of kiln's; its message says which file, what was being done and errno's text.
//
//   KILN_IO_CHECK(fd >= 0, "cannot create '", path, "': ", std::strerror(errno));
#include <sstream>
#include <stdexcept>
#include <string>

namespace kiln {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};
class CudaError : public Error { using Error::Error; };
class CudnnError : public Error { using Error::Error; };
class CublasError : public Error { using Error::Error; };
class NcclError : public Error { using Error::Error; };
class OutOfMemoryError : public Error { using Error::Error; };
class IoError : public Error { using Error::Error; };

// Which class detail::fail throws: Error, CudaError, CudnnError, CublasError, NcclError,
// OutOfMemoryError, IoError.
enum class ErrorKind { Generic, Cuda, Cudnn, Cublas, Nccl, OutOfMemory, Io };

// `what` without the " [dir/file.cpp:12, check failed: ...]" parts detail::fail adds, wherever
// they stand (a message that wraps another's what() holds the inner one mid-text): for passing on
// a library's message about the user's own input.
std::string strip_location(const std::string& what);

namespace detail {

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
inline std::string str_cat() { return {}; }

[[noreturn]] void fail(ErrorKind kind, const char* file, int line, const char* expr,
                       const std::string& msg);

}  // namespace detail
}  // namespace kiln

#define KILN_CHECK(cond, ...)                                                       \
  do {                                                                              \
    if (!(cond)) [[unlikely]]                                                       \
      ::kiln::detail::fail(::kiln::ErrorKind::Generic, __FILE__, __LINE__, #cond,   \
                           ::kiln::detail::str_cat(__VA_ARGS__));                   \
  } while (0)

#define KILN_FAIL(...)                                                              \
  ::kiln::detail::fail(::kiln::ErrorKind::Generic, __FILE__, __LINE__, nullptr,     \
                       ::kiln::detail::str_cat(__VA_ARGS__))

#define KILN_IO_CHECK(cond, ...)                                                    \
  do {                                                                              \
    if (!(cond)) [[unlikely]]                                                       \
      ::kiln::detail::fail(::kiln::ErrorKind::Io, __FILE__, __LINE__, #cond,        \
                           ::kiln::detail::str_cat(__VA_ARGS__));                   \
  } while (0)

#define KILN_IO_FAIL(...)                                                           \
  ::kiln::detail::fail(::kiln::ErrorKind::Io, __FILE__, __LINE__, nullptr,          \
                       ::kiln::detail::str_cat(__VA_ARGS__))
