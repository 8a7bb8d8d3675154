#include "core/serialization.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <algorithm>
#include <sstream>

#include "core/json.h"

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
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KILN_CHECK(fd >= 0, "cannot create '", tmp, "': ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      KILN_FAIL("writing '", tmp, "' failed: ", std::strerror(err));
    }
    done += size_t(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    KILN_FAIL("flushing '", tmp, "' failed: ", std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    KILN_FAIL("renaming '", tmp, "' to '", path, "' failed: ", std::strerror(err));
  }
  // Make the rename itself durable.
  int dfd = ::open(dir_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::ostringstream header;
  header << "{";
  bool first = true;
  if (!metadata.empty()) {
    header << "\"__metadata__\":{";
    for (auto it = metadata.begin(); it != metadata.end(); ++it) {
      if (it != metadata.begin()) header << ",";
      header << json::quote(it->first) << ":" << json::quote(it->second);
    }
    header << "}";
    first = false;
  }
  std::vector<Tensor> hosts;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    KILN_CHECK(t.defined(), "save_safetensors '", path, "': tensor '", name, "' is undefined");
    KILN_CHECK(name != "__metadata__", "save_safetensors: reserved tensor name __metadata__");
    Tensor h = t.detach().to(Device::cpu()).contiguous();
    size_t n = h.nbytes();
    if (!first) header << ",";
    first = false;
    header << json::quote(name) << ":{\"dtype\":\"" << st_dtype(h.dtype()) << "\",\"shape\":[";
    for (int64_t i = 0; i < h.dim(); ++i) header << (i ? "," : "") << h.size(i);
    header << "],\"data_offsets\":[" << offset << "," << offset + n << "]}";
    offset += n;
    hosts.push_back(h);
  }
  header << "}";
  std::string hs = header.str();
  while (hs.size() % 8) hs += ' ';  // align the data section
  std::string bytes;
  bytes.reserve(8 + hs.size() + offset);
  uint64_t hl = hs.size();
  for (int i = 0; i < 8; ++i) bytes.push_back(char((hl >> (8 * i)) & 0xff));
  bytes += hs;
  for (const Tensor& h : hosts) bytes.append(static_cast<const char*>(h.raw_data()), h.nbytes());
  write_file_atomic(path, bytes);
}

SafetensorsData load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "cannot open safetensors file '", path, "'");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  KILN_CHECK(bytes.size() >= 8, "'", path, "' is not a safetensors file (", bytes.size(),
             " bytes, shorter than the 8-byte header length)");
  uint64_t hl = 0;
  for (int i = 0; i < 8; ++i) hl |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  KILN_CHECK(hl <= bytes.size() - 8, "'", path, "': header length ", hl, " exceeds the file size ",
             bytes.size(), " (truncated or not a safetensors file)");
  json::Value header;
  try {
    header = json::parse(bytes.substr(8, hl));
  } catch (const Error& e) {
    KILN_FAIL("'", path, "': malformed safetensors header: ", e.what());
  }
  KILN_CHECK(header.is_object(), "'", path, "': safetensors header is not a JSON object");
  const size_t data_start = 8 + hl, data_size = bytes.size() - data_start;
  SafetensorsData out;
  out.path = path;
  for (const auto& [name, v] : header.object()) {
    if (name == "__metadata__") {
      for (const auto& [k, mv] : v.object()) out.metadata[k] = mv.str();
      continue;
    }
    DType dt;
    KILN_CHECK(parse_st_dtype(v.at("dtype").str(), &dt), "'", path, "': tensor '", name,
               "' has unsupported dtype ", v.at("dtype").str());
    Shape shape;
    for (const auto& d : v.at("shape").array()) shape.push_back(int64_t(d.number()));
    const auto& offs = v.at("data_offsets").array();
    KILN_CHECK(offs.size() == 2, "'", path, "': tensor '", name, "' needs two data_offsets");
    uint64_t b = uint64_t(offs[0].number()), e = uint64_t(offs[1].number());
    KILN_CHECK(b <= e && e <= data_size, "'", path, "': tensor '", name, "' data [", b, ", ", e,
               ") lies outside the ", data_size, "-byte data section (truncated file?)");
    KILN_CHECK(e - b == uint64_t(shape_numel(shape)) * dtype_size(dt), "'", path, "': tensor '",
               name, "' has ", e - b, " bytes for ", dtype_name(dt), shape_str(shape));
    Tensor t = empty(shape, dt);
    std::memcpy(t.raw_data(), bytes.data() + data_start + b, e - b);
    out.tensors.emplace_back(name, t);
  }
  // File order = data offset order (JSON objects may be reordered by writers).
  std::stable_sort(out.tensors.begin(), out.tensors.end(), [&](const auto& x, const auto& y) {
    return header.object().at(x.first).at("data_offsets").array()[0].number() <
           header.object().at(y.first).at("data_offsets").array()[0].number();
  });
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

}  // namespace kiln
