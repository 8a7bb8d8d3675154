#include "data/idx.h"

#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

namespace kiln::data {
namespace {

// Deflate cannot compress better than about 1032:1, so a gzip file of S bytes holds at most
// ~1032*S bytes; a header claiming more is lying, and we refuse before allocating.
constexpr uint64_t kDeflateMaxRatio = 1032;

std::string quoted(const std::string& path) { return "'" + path + "'"; }

// A sequential byte source over a raw or a gzipped file; reads report short counts at the end.
class IdxStream {
 public:
  explicit IdxStream(const std::string& path) : path_(path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    KILN_CHECK(fs::exists(path, ec), "IDX file ", quoted(path), " does not exist");
    KILN_CHECK(!fs::is_directory(path, ec), "IDX file ", quoted(path), " is a directory");
    file_size_ = uint64_t(fs::file_size(path, ec));
    KILN_CHECK(!ec, "cannot stat IDX file ", quoted(path), ": ", ec.message());

    raw_ = std::fopen(path.c_str(), "rb");
    KILN_CHECK(raw_, "cannot open IDX file ", quoted(path), ": ", std::strerror(errno));
    unsigned char sig[2] = {0, 0};
    size_t n = std::fread(sig, 1, 2, raw_);
    if (n == 2 && sig[0] == 0x1f && sig[1] == 0x8b) {
      std::fclose(raw_);
      raw_ = nullptr;
      gz_ = gzopen(path.c_str(), "rb");
      KILN_CHECK(gz_, "cannot open gzipped IDX file ", quoted(path), ": ", std::strerror(errno));
      gzbuffer(gz_, 1 << 18);
    } else {
      std::rewind(raw_);
    }
  }
  ~IdxStream() {
    if (raw_) std::fclose(raw_);
    if (gz_) gzclose(gz_);
  }
  IdxStream(const IdxStream&) = delete;
  IdxStream& operator=(const IdxStream&) = delete;

  bool gzipped() const { return gz_ != nullptr; }
  uint64_t file_size() const { return file_size_; }

  // Reads up to n bytes; returns how many arrived. Throws on an I/O error or corrupt gzip
  // data; a gzip stream that simply ends early counts as a short read (a truncated file).
  uint64_t read(void* dst, uint64_t n) {
    auto* p = static_cast<unsigned char*>(dst);
    uint64_t got = 0;
    while (got < n) {
      if (raw_) {
        size_t r = std::fread(p + got, 1, size_t(n - got), raw_);
        got += r;
        if (r == 0) {
          KILN_CHECK(!std::ferror(raw_), "read error in IDX file ", quoted(path_), ": ",
                     std::strerror(errno));
          break;
        }
      } else {
        unsigned chunk = unsigned(std::min<uint64_t>(n - got, uint64_t(1) << 30));
        int r = gzread(gz_, p + got, chunk);
        if (r > 0) got += uint64_t(r);
        if (r < int(chunk)) {
          int errnum = Z_OK;
          const char* msg = gzerror(gz_, &errnum);
          // Z_BUF_ERROR is zlib's "unexpected end of file": the stream was cut short.
          KILN_CHECK(errnum == Z_OK || errnum == Z_BUF_ERROR, "corrupt gzip data in IDX file ",
                     quoted(path_), ": ", msg ? msg : "unknown zlib error");
          if (r <= 0) break;
        }
      }
    }
    return got;
  }

 private:
  std::string path_;
  std::FILE* raw_ = nullptr;
  gzFile gz_ = nullptr;
  uint64_t file_size_ = 0;
};

uint32_t big_endian_u32(const unsigned char* b) {
  return uint32_t(b[0]) << 24 | uint32_t(b[1]) << 16 | uint32_t(b[2]) << 8 | uint32_t(b[3]);
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

}  // namespace

Tensor read_idx(const std::string& path, uint32_t expected_magic) {
  IdxStream in(path);
  const char* kind = in.gzipped() ? "gzipped IDX file " : "IDX file ";

  unsigned char head[4];
  uint64_t got = in.read(head, 4);
  KILN_CHECK(got == 4, kind, quoted(path), " is truncated: expected at least 4 header bytes, got ",
             got);
  const uint32_t magic = big_endian_u32(head);
  if (expected_magic != 0) {
    KILN_CHECK(magic == expected_magic, kind, quoted(path), ": wrong magic number ", hex32(magic),
               ", expected ", hex32(expected_magic), " (u8 data with ", expected_magic & 0xff,
               " dims)");
  } else {
    KILN_CHECK(head[0] == 0 && head[1] == 0 && head[2] == 0x08 && head[3] >= 1, kind, quoted(path),
               ": wrong magic number ", hex32(magic),
               ", expected 0x000008NN (u8 data with NN >= 1 dims)");
  }

  const int ndim = head[3];
  const uint64_t header_bytes = 4 + 4 * uint64_t(ndim);
  std::vector<unsigned char> dim_bytes(size_t(4 * ndim));
  got = in.read(dim_bytes.data(), dim_bytes.size());
  KILN_CHECK(got == dim_bytes.size(), kind, quoted(path), " is truncated: expected ", header_bytes,
             " header bytes, got ", 4 + got);

  // Guard the product against overflow: anything past 2^62 is absurd anyway.
  Shape shape(static_cast<size_t>(ndim), 0);
  uint64_t data_bytes = 1;
  bool overflow = false;
  for (int d = 0; d < ndim; ++d) {
    const uint64_t v = big_endian_u32(&dim_bytes[size_t(4 * d)]);
    shape[size_t(d)] = int64_t(v);
    if (v != 0 && data_bytes > (uint64_t(1) << 62) / v) overflow = true;
    data_bytes *= v;
  }
  KILN_CHECK(!overflow, kind, quoted(path), ": absurd header dims ", shape_str(shape),
             " (element count overflows)");

  if (in.gzipped()) {
    const uint64_t cap = std::min(kIdxMaxGzipBytes, in.file_size() * kDeflateMaxRatio);
    KILN_CHECK(data_bytes <= cap, kind, quoted(path), ": absurd header dims ", shape_str(shape),
               " claim ", data_bytes, " bytes of data; a ", in.file_size(),
               "-byte gzip file can hold at most ", cap);
  } else {
    const uint64_t have = in.file_size() - header_bytes;
    KILN_CHECK(have >= data_bytes, kind, quoted(path), " is truncated: header dims ",
               shape_str(shape), " need ", data_bytes, " bytes of data after the ", header_bytes,
               "-byte header, got ", have);
  }

  Tensor out = empty(shape, DType::u8);
  got = in.read(out.data<uint8_t>(), data_bytes);
  KILN_CHECK(got == data_bytes, kind, quoted(path), " is truncated: header dims ", shape_str(shape),
             " need ", data_bytes, " bytes of data after the ", header_bytes, "-byte header, got ",
             got);
  unsigned char extra[64];
  const uint64_t trailing = in.read(extra, sizeof extra);
  KILN_CHECK(trailing == 0, kind, quoted(path), ": unexpected bytes after the ", data_bytes,
             " bytes of data that header dims ", shape_str(shape), " describe (",
             trailing == sizeof extra ? "at least " : "", trailing, " more)");
  return out;
}

Tensor read_idx_images(const std::string& path) { return read_idx(path, kIdxMagicU8Images); }

Tensor read_idx_labels(const std::string& path) { return read_idx(path, kIdxMagicU8Labels); }

IdxPair read_idx_pair(const std::string& images_path, const std::string& labels_path) {
  IdxPair p{read_idx_images(images_path), read_idx_labels(labels_path), images_path, labels_path};
  KILN_CHECK(p.images.size(0) == p.labels.size(0), "IDX count mismatch: ", quoted(images_path),
             " holds ", p.images.size(0), " images but ", quoted(labels_path), " holds ",
             p.labels.size(0), " labels");
  return p;
}

void check_labels(const IdxPair& p, int64_t num_classes) {
  const uint8_t* y = p.labels.data<uint8_t>();
  for (int64_t i = 0; i < p.labels.numel(); ++i)
    KILN_CHECK(int64_t(y[i]) < num_classes, quoted(p.labels_path), ": label ", int(y[i]),
               " at index ", i, " is out of range for ", num_classes, " classes (0..",
               num_classes - 1, ")");
}

int64_t infer_num_classes(const IdxPair& train, int64_t min_classes) {
  const uint8_t* y = train.labels.data<uint8_t>();
  int64_t count[256] = {};
  int64_t top = -1, top_at = 0;
  for (int64_t i = 0; i < train.labels.numel(); ++i) {
    ++count[y[i]];
    if (int64_t(y[i]) > top) top = y[i], top_at = i;
  }
  if (top < min_classes) return min_classes;
  int64_t missing = 0, first_missing = -1;
  for (int64_t c = 0; c < top; ++c)
    if (count[c] == 0) missing += 1, first_missing = first_missing < 0 ? c : first_missing;
  KILN_CHECK(missing == 0, quoted(train.labels_path), ": label ", top, " at index ", top_at,
             " implies ", top + 1, " classes, but ", missing,
             " of the labels below it never "
             "occur (the first: ",
             first_missing,
             "); a stray label? Labels must be classes "
             "0..K-1");
  return top + 1;
}

}  // namespace kiln::data
