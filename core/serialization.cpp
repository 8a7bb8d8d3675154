#include "core/serialization.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "core/json.h"
#include "core/text.h"

namespace kiln {
namespace {

const char* st_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
    case DType::boolean: return "BOOL";
  }
  return "?";
}

bool parse_st_dtype(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> table[] = {
      {"F32", DType::f32}, {"F64", DType::f64}, {"F16", DType::f16}, {"BF16", DType::bf16},
      {"I32", DType::i32}, {"I64", DType::i64}, {"U8", DType::u8},   {"BOOL", DType::boolean}};
  for (auto& [name, t] : table)
    if (s == name) {
      *out = t;
      return true;
    }
  return false;
}

std::string dir_of(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

void write_file_atomic(const std::string& path, const std::string& bytes) {
  // What is there already must be a regular file (or nothing): renaming over a device node, a
  // FIFO or a folder would replace something that is not a file this write produced.
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    KILN_IO_FAIL("'", path, "' exists and is not a regular file (",
                 S_ISDIR(st.st_mode) ? "a folder" : "a device, FIFO or socket",
                 "); refusing to replace it: choose another file name");
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  // O_EXCL | O_NOFOLLOW: never through a link or into a file someone left under that name.
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  KILN_IO_CHECK(fd >= 0, "cannot create '", tmp, "' (to be renamed to '", path,
                "'): ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      KILN_IO_FAIL("writing '", path, "' failed: ", std::strerror(err), " (", done, " of ",
                   bytes.size(), " bytes written; the temporary file is removed)");
    }
    done += size_t(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    KILN_IO_FAIL("flushing '", path, "' failed: ", std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    KILN_IO_FAIL("renaming '", tmp, "' to '", path, "' failed: ", std::strerror(err));
  }
  // Make the rename itself durable.
  int dfd = ::open(dir_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

SafetensorsHost safetensors_host(const std::string& path, const NamedTensors& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  std::ostringstream header;
  header << "{";
  bool first = true;
  if (!metadata.empty()) {
    header << "\"__metadata__\":{";
    for (auto it = metadata.begin(); it != metadata.end(); ++it) {
      if (it != metadata.begin()) header << ",";
      KILN_CHECK(text::is_valid_utf8(it->first) && text::is_valid_utf8(it->second),
                 "save_safetensors '", path, "': metadata '", text::printable(it->first),
                 "' is not UTF-8 (a safetensors header is UTF-8 JSON)");
      header << json::quote(it->first) << ":" << json::quote(it->second);
    }
    header << "}";
    first = false;
  }
  SafetensorsHost out;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    KILN_CHECK(t.defined(), "save_safetensors '", path, "': tensor '", name, "' is undefined");
    KILN_CHECK(name != "__metadata__", "save_safetensors: reserved tensor name __metadata__");
    KILN_CHECK(text::is_valid_utf8(name), "save_safetensors '", path, "': tensor name '",
               text::printable(name), "' is not UTF-8 (a safetensors header is UTF-8 JSON)");
    // A copy of its own in either case: to(cpu) of a CPU tensor would be the tensor itself.
    Tensor h = t.is_cpu() ? t.detach().clone(MemoryFormat::Contiguous)
                          : t.detach().to(Device::cpu()).contiguous();
    size_t n = h.nbytes();
    if (!first) header << ",";
    first = false;
    header << json::quote(name) << ":{\"dtype\":\"" << st_dtype(h.dtype()) << "\",\"shape\":[";
    for (int64_t i = 0; i < h.dim(); ++i) header << (i ? "," : "") << h.size(i);
    header << "],\"data_offsets\":[" << offset << "," << offset + n << "]}";
    offset += n;
    out.tensors.emplace_back(name, std::move(h));
  }
  header << "}";
  std::string hs = header.str();
  while (hs.size() % 8) hs += ' ';  // align the data section
  const uint64_t hl = hs.size();
  for (int i = 0; i < 8; ++i) out.header.push_back(char((hl >> (8 * i)) & 0xff));
  out.header += hs;
  return out;
}

std::string SafetensorsHost::join() const {
  size_t n = header.size();
  for (const auto& [name, h] : tensors) n += h.nbytes();
  std::string bytes;
  bytes.reserve(n);
  bytes += header;
  for (const auto& [name, h] : tensors)
    bytes.append(static_cast<const char*>(h.raw_data()), h.nbytes());
  return bytes;
}

std::string safetensors_bytes(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata) {
  return safetensors_host(path, tensors, metadata).join();
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  write_file_atomic(path, safetensors_bytes(path, tensors, metadata));
}

namespace {

// An open file descriptor, closed on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads exactly n bytes at `offset` into dst; errors name the file and what was being read.
void read_exact(int fd, void* dst, size_t n, uint64_t offset, const std::string& path,
                const std::string& what) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    const size_t chunk = std::min<size_t>(n, size_t(1) << 30);
    ssize_t got = ::pread(fd, p, chunk, off_t(offset));
    if (got < 0 && errno == EINTR) continue;
    KILN_CHECK(
        got > 0, "'", path, "': reading ", what, " failed at byte ", offset, ": ",
        got == 0 ? "unexpected end of file (truncated while reading?)" : std::strerror(errno));
    p += got;
    n -= size_t(got);
    offset += uint64_t(got);
  }
}

struct TensorEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

// One header entry, checked against the safetensors rules; errors name the file and the tensor.
TensorEntry parse_entry(const std::string& path, const std::string& name, const json::Value& v,
                        uint64_t data_size) {
  auto where = [&] { return "'" + path + "': tensor '" + name + "'"; };
  KILN_CHECK(v.is_object(), where(), ": header entry is not a JSON object");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    KILN_CHECK(v.contains(key), where(), ": header entry has no '", key, "'");
  TensorEntry t;
  t.name = name;
  const json::Value& dt = v.at("dtype");
  KILN_CHECK(dt.kind() == json::Value::Kind::String, where(), ": dtype is not a string");
  KILN_CHECK(parse_st_dtype(dt.str(), &t.dtype), where(), ": unsupported dtype '", dt.str(),
             "' (kiln reads F32, F64, F16, BF16, I32, I64, U8, BOOL)");
  const json::Value& shape = v.at("shape");
  KILN_CHECK(shape.kind() == json::Value::Kind::Array, where(), ": shape is not an array");
  int64_t numel = 1;
  for (const json::Value& d : shape.array()) {
    KILN_CHECK(d.is_integer() && d.number() >= 0 && d.unsigned_integer() <= uint64_t(INT64_MAX),
               where(), ": shape entries must be non-negative integers below 2^63");
    const int64_t n = int64_t(d.unsigned_integer());
    t.shape.push_back(n);
    KILN_CHECK(!__builtin_mul_overflow(numel, n, &numel), where(), ": shape ", shape_str(t.shape),
               "... has more than 2^63 elements");
  }
  int64_t nbytes = 0;
  KILN_CHECK(!__builtin_mul_overflow(numel, int64_t(dtype_size(t.dtype)), &nbytes), where(), ": ",
             dtype_name(t.dtype), shape_str(t.shape), " needs more than 2^63 bytes");
  const json::Value& offs = v.at("data_offsets");
  KILN_CHECK(offs.kind() == json::Value::Kind::Array && offs.array().size() == 2, where(),
             ": data_offsets must be an array [begin, end]");
  for (const json::Value& o : offs.array())
    KILN_CHECK(o.is_integer() && o.number() >= 0, where(),
               ": data_offsets must be non-negative integers");
  t.begin = offs.array()[0].unsigned_integer();
  t.end = offs.array()[1].unsigned_integer();
  KILN_CHECK(t.begin <= t.end && t.end <= data_size, where(), ": data [", t.begin, ", ", t.end,
             ") lies outside the ", data_size, "-byte data section (truncated file?)");
  KILN_CHECK(t.end - t.begin == uint64_t(nbytes), where(), " has ", t.end - t.begin, " bytes for ",
             dtype_name(t.dtype), shape_str(t.shape), " (", nbytes, " needed)");
  return t;
}

}  // namespace

SafetensorsData load_safetensors(const std::string& path) {
  Fd f;
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  KILN_IO_CHECK(f.fd >= 0, "cannot open safetensors file '", path, "': ", std::strerror(errno));
  struct stat st;
  KILN_IO_CHECK(::fstat(f.fd, &st) == 0, "cannot stat '", path, "': ", std::strerror(errno));
  KILN_IO_CHECK(S_ISREG(st.st_mode), "'", path,
             "' is not a regular file (a folder, FIFO or device); expected a safetensors file");
  const uint64_t size = uint64_t(st.st_size);
  KILN_CHECK(size >= 8, "'", path, "' is not a safetensors file (", size,
             " bytes, shorter than the 8-byte header length)");
  unsigned char len[8];
  read_exact(f.fd, len, 8, 0, path, "the header length");
  uint64_t hl = 0;
  for (int i = 0; i < 8; ++i) hl |= uint64_t(len[i]) << (8 * i);
  KILN_CHECK(hl <= size - 8, "'", path, "': header length ", hl, " exceeds the file size ", size,
             " (truncated or not a safetensors file)");
  KILN_CHECK(hl <= kMaxSafetensorsHeader, "'", path, "': header length ", hl,
             " exceeds the limit of ", kMaxSafetensorsHeader, " bytes");
  std::string text(size_t(hl), '\0');
  read_exact(f.fd, text.data(), text.size(), 8, path, "the header");
  KILN_CHECK(!text.empty() && text[0] == '{', "'", path,
             "': malformed safetensors header: it must start with '{'");
  json::Value header;
  try {
    header = json::parse(text);
  } catch (const Error& e) {
    KILN_FAIL("'", path, "': malformed safetensors header: ", strip_location(e.what()));
  }
  KILN_CHECK(header.is_object(), "'", path, "': safetensors header is not a JSON object");
  const uint64_t data_start = 8 + hl, data_size = size - data_start;
  SafetensorsData out;
  out.path = path;
  std::vector<TensorEntry> entries;
  for (const auto& [name, v] : header.object()) {
    if (name == "__metadata__") {
      KILN_CHECK(v.is_object(), "'", path, "': __metadata__ is not a JSON object");
      for (const auto& [k, mv] : v.object()) {
        KILN_CHECK(mv.kind() == json::Value::Kind::String, "'", path, "': __metadata__ '", k,
                   "' is not a string");
        out.metadata[k] = mv.str();
      }
      continue;
    }
    entries.push_back(parse_entry(path, name, v, data_size));
  }
  // File order = data offset order (JSON objects may be reordered by writers). The data section
  // must be covered exactly: no holes, no overlaps, nothing after the last tensor.
  std::stable_sort(entries.begin(), entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const TensorEntry* prev = nullptr;
  for (const TensorEntry& e : entries) {
    KILN_CHECK(e.begin >= cursor, "'", path, "': tensor '", e.name, "' data [", e.begin, ", ",
               e.end, ") overlaps tensor '", prev ? prev->name : "", "' (ends at ", cursor, ")");
    KILN_CHECK(e.begin == cursor, "'", path, "': bytes [", cursor, ", ", e.begin,
               ") of the data section belong to no tensor (a hole before tensor '", e.name, "')");
    cursor = e.end;
    prev = &e;
  }
  KILN_CHECK(cursor == data_size, "'", path, "': bytes [", cursor, ", ", data_size,
             ") at the end of the data section belong to no tensor");
  // One copy: file bytes straight into each tensor's storage.
  for (const TensorEntry& e : entries) {
    Tensor t = empty(e.shape, e.dtype);
    read_exact(f.fd, t.raw_data(), size_t(e.end - e.begin), data_start + e.begin, path,
               "tensor '" + e.name + "'");
    out.tensors.emplace_back(e.name, t);
  }
  return out;
}

const Tensor& SafetensorsData::at(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  KILN_FAIL("'", path, "' has no tensor named '", name, "'");
}

bool SafetensorsData::contains(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return true;
  return false;
}

namespace {

// Whether a contiguous host tensor of unsigned-integer-sized floats holds a NaN or an infinity:
// an element whose exponent bits are all ones. Reads the bits where they lie (no conversion), so
// it costs one pass over the bytes.
template <typename U>
bool any_non_finite(const Tensor& h, U exponent) {
  const auto* p = static_cast<const unsigned char*>(h.raw_data());
  const int64_t n = h.numel();  // hoisted: a call in the condition keeps the loop scalar
  U bad = 0;  // an integer OR reduction, which vectorises (a bool one does not)
  for (int64_t i = 0; i < n; ++i) {
    U bits;
    std::memcpy(&bits, p + i * int64_t(sizeof(U)), sizeof(U));
    bad |= U((bits & exponent) == exponent);
  }
  return bad != 0;
}

}  // namespace

std::string first_non_finite(const NamedTensors& tensors) {
  for (const auto& [name, t] : tensors) {
    if (!is_floating(t.dtype())) continue;
    const Tensor h = t.detach().to(Device::cpu()).contiguous();
    bool bad = false;
    switch (h.dtype()) {
      case DType::f16: bad = any_non_finite<uint16_t>(h, 0x7C00u); break;
      case DType::bf16: bad = any_non_finite<uint16_t>(h, 0x7F80u); break;
      case DType::f32: bad = any_non_finite<uint32_t>(h, 0x7F800000u); break;
      case DType::f64: bad = any_non_finite<uint64_t>(h, 0x7FF0000000000000ull); break;
      default: KILN_FAIL("first_non_finite: '", name, "' has an unexpected dtype ", h.desc());
    }
    if (bad) return name;
  }
  return "";
}

void check_finite(const SafetensorsData& file, const std::string& what) {
  const std::string bad = first_non_finite(file.tensors);
  if (bad.empty()) return;
  throw Error(what + " '" + file.path + "': tensor '" + bad +
              "' holds NaN or infinite values; refusing weights that cannot have come from a "
              "finished training run");
}

}  // namespace kiln
