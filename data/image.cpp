#include "data/image.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "core/text.h"
#include "data/jpeg_turbo.h"

// The stb implementations live here, once in kiln, as static functions so that no other
// translation unit (a tool or test that includes stb itself) can clash with them. Only the two
// formats we accept are compiled in: less decoder surface for untrusted files.
#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#define STBI_ONLY_JPEG
#define STBI_ONLY_PNG
#define STBI_NO_STDIO
#define STBI_MAX_DIMENSIONS 16384  // stb's own guard, behind ours
#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#include <stb_image.h>
#include <stb_image_write.h>
#pragma GCC diagnostic pop

namespace kiln::data {
namespace {

bool is_png(const uint8_t* data, size_t size) {
  static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  return size >= 8 && std::memcmp(data, sig, 8) == 0;
}

static_assert(kMaxImageSide <= STBI_MAX_DIMENSIONS, "our guard must be the tighter one");

const char* stb_reason() {
  const char* r = stbi_failure_reason();
  return r ? r : "unknown reason";
}

void check_writable(const Image& im, const char* what) {
  KILN_CHECK(im.channels == 1 || im.channels == 3, what, ": channels must be 1 or 3, got ",
             im.channels);
  KILN_CHECK(
      im.height > 0 && im.width > 0 && im.height <= kMaxImageSide && im.width <= kMaxImageSide,
      what, ": bad image size ", im.height, "x", im.width);
  KILN_CHECK(int64_t(im.pixels.size()) == im.height * im.width * im.channels, what, ": ",
             im.pixels.size(), " pixel bytes for a ", im.height, "x", im.width, "x", im.channels,
             " image");
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  errno = 0;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  KILN_IO_CHECK(f, "cannot open '", path, "' for writing: ", std::strerror(errno));
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  f.close();
  KILN_IO_CHECK(f, "writing '", path, "' failed: ", std::strerror(errno));
}

// The width and height a PNG's IHDR or a JPEG's frame header (SOFn) claims, read without stb:
// stb's own probe gives up on sides over STBI_MAX_DIMENSIONS ("unknown image type"), and the
// user should hear the size instead. False when the header is not found.
bool header_size(const uint8_t* d, size_t n, int64_t* w, int64_t* h) {
  auto be16 = [&](size_t i) { return int64_t(d[i]) << 8 | d[i + 1]; };
  auto be32 = [&](size_t i) { return be16(i) << 16 | be16(i + 2); };
  if (n >= 24 && is_png(d, n) && std::memcmp(d + 12, "IHDR", 4) == 0) {
    *w = be32(16);
    *h = be32(20);
    return true;
  }
  if (n < 4 || d[0] != 0xFF || d[1] != 0xD8) return false;
  for (size_t i = 2; i + 4 <= n;) {  // marker segments up to the frame header
    if (d[i] != 0xFF) return false;
    const uint8_t m = d[i + 1];
    if (m == 0xFF) {  // fill byte
      ++i;
      continue;
    }
    if (m == 0x01 || (m >= 0xD0 && m <= 0xD7)) {  // markers without a length
      i += 2;
      continue;
    }
    const bool sof = m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
    if (sof) {
      if (i + 9 > n) return false;
      *h = be16(i + 5);
      *w = be16(i + 7);
      return true;
    }
    if (m == 0xDA || m == 0xD9) return false;  // scan or end before any frame header
    i += 2 + size_t(be16(i + 2));
  }
  return false;
}

// A PNG whose chunks do not fit in the file, named before stb sees it: stb grows its IDAT
// buffer to a chunk's claimed length before reading it (an 834-byte file made it ask for 2 GiB).
// Walks the chunk headers (length, type, data, CRC) up to IEND.
void check_png_chunks(const uint8_t* d, size_t n, const std::string& name) {
  if (!is_png(d, n)) return;  // not a PNG: stb says what it is
  for (size_t i = 8; i + 8 <= n;) {
    const uint64_t len = uint64_t(d[i]) << 24 | uint64_t(d[i + 1]) << 16 |
                         uint64_t(d[i + 2]) << 8 | uint64_t(d[i + 3]);
    const std::string type(reinterpret_cast<const char*>(d + i + 4), 4);
    const uint64_t room = uint64_t(n - i) - 12;  // n - i >= 8; a chunk needs 12 bytes besides
    KILN_CHECK(n - i >= 12 && len <= room, "image '", name, "': corrupt PNG (chunk '",
               text::printable(type), "' at byte ", i, " claims ", len, " bytes, ",
               n - i < 12 ? 0 : room, " remain)");
    if (type == "IEND") return;
    i += 12 + size_t(len);
  }
}

void check_size_limits(int64_t w, int64_t h, const std::string& name) {
  KILN_CHECK(h > 0 && w > 0 && h <= kMaxImageSide && w <= kMaxImageSide && h * w <= kMaxImagePixels,
             "image '", name, "': header claims ", w, "x", h, " pixels, over the limit (",
             kMaxImageSide, " per side, ", kMaxImagePixels, " in all)");
}

void append_bytes(void* ctx, void* data, int size) {
  auto* out = static_cast<std::vector<uint8_t>*>(ctx);
  const auto* p = static_cast<const uint8_t*>(data);
  out->insert(out->end(), p, p + size);
}

}  // namespace

void read_file_into(const std::string& path, std::vector<uint8_t>& out, int64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  KILN_CHECK(fd >= 0, "cannot open image file '", path, "': ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  KILN_CHECK(::fstat(fd, &st) == 0, "cannot stat image file '", path, "': ", std::strerror(errno));
  KILN_CHECK(S_ISREG(st.st_mode), "image file '", path, "' is not a regular file");
  KILN_CHECK(int64_t(st.st_size) <= max_bytes, "image file '", path, "' is ", int64_t(st.st_size),
             " bytes, over the per-file limit of ", max_bytes, " bytes");
  out.resize(size_t(st.st_size));
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    KILN_CHECK(n >= 0, "error reading image file '", path, "': ", std::strerror(errno));
    if (n == 0) break;  // shrank while reading: decode what is there
    done += size_t(n);
  }
  out.resize(done);
}

std::vector<uint8_t> read_file_bytes(const std::string& path, int64_t max_bytes) {
  std::vector<uint8_t> bytes;
  read_file_into(path, bytes, max_bytes);
  return bytes;
}

namespace {

// stb_image's JPEG decoder reads out of bounds on some corrupt files (a fuzzer found it in
// seconds, docs/lab/input-pipeline.md, 2026-12-05). Where kiln has libjpeg-turbo, everything
// but a PNG goes to it (stb would also take a JPEG behind leading fill bytes, a fuzzed file of
// that shape reached the same read), and stb sees JPEGs only through decode_image_stb. A file
// that is neither gets stb's words for it, as before.
bool jpeg_to_turbo(const uint8_t* data, size_t size, const std::string& name) {
  if (!jpeg_turbo_available() || is_png(data, size)) return false;
  KILN_CHECK(looks_like_jpeg(data, size), "image '", name,
             "': not a readable JPEG/PNG (unknown image type)");
  return true;
}

}  // namespace

ImageInfo probe_image(const uint8_t* data, size_t size, const std::string& name) {
  KILN_CHECK(size > 0, "image '", name, "': empty file");
  if (jpeg_to_turbo(data, size, name)) {
    int64_t hw = 0, hh = 0;
    if (header_size(data, size, &hw, &hh)) check_size_limits(hw, hh, name);
    const JpegInfo j = read_jpeg_info(data, size, name);
    return {j.height, j.width, j.components == 1 ? 1 : 3};
  }
  return probe_image_stb(data, size, name);
}

ImageInfo probe_image_stb(const uint8_t* data, size_t size, const std::string& name) {
  KILN_CHECK(size > 0, "image '", name, "': empty file");
  check_png_chunks(data, size, name);
  KILN_CHECK(size <= size_t(INT32_MAX), "image '", name, "': file too large (", size, " bytes)");
  int w = 0, h = 0, c = 0;
  if (!stbi_info_from_memory(data, int(size), &w, &h, &c)) {
    const std::string reason = stb_reason();
    int64_t hw = 0, hh = 0;
    if (header_size(data, size, &hw, &hh) && (hw > kMaxImageSide || hh > kMaxImageSide))
      check_size_limits(hw, hh, name);
    KILN_FAIL("image '", name, "': not a readable JPEG/PNG (", reason, ")");
  }
  return {h, w, c};
}

Image decode_image(const uint8_t* data, size_t size, const std::string& name) {
  KILN_CHECK(size > 0, "image '", name, "': empty file");
  if (jpeg_to_turbo(data, size, name)) {
    (void)probe_image(data, size, name);  // the size guard, from the header
    return decode_jpeg(data, size, name);
  }
  return decode_image_stb(data, size, name);
}

Image decode_image_stb(const uint8_t* data, size_t size, const std::string& name) {
  const ImageInfo info = probe_image_stb(data, size, name);
  check_size_limits(info.width, info.height, name);
  int w = 0, h = 0, c = 0;
  stbi_uc* px = stbi_load_from_memory(data, int(size), &w, &h, &c, 3);
  if (!px) KILN_FAIL("image '", name, "': decoding failed (", stb_reason(), ")");
  Image im;
  im.height = h;
  im.width = w;
  im.channels = 3;
  im.pixels.assign(px, px + size_t(h) * size_t(w) * 3);
  stbi_image_free(px);
  // The decoder must agree with the header we checked.
  KILN_CHECK(h == info.height && w == info.width, "image '", name, "': header says ", info.width,
             "x", info.height, " but decoded ", w, "x", h);
  return im;
}

Image read_image(const std::string& path, int64_t max_bytes) {
  const std::vector<uint8_t> bytes = read_file_bytes(path, max_bytes);
  return decode_image(bytes.data(), bytes.size(), path);
}

std::vector<uint8_t> encode_png(const Image& im) {
  check_writable(im, "encode_png");
  std::vector<uint8_t> out;
  const int stride = int(im.width * im.channels);
  KILN_CHECK(stbi_write_png_to_func(append_bytes, &out, int(im.width), int(im.height),
                                    int(im.channels), im.pixels.data(), stride),
             "encode_png: stb_image_write failed for a ", im.width, "x", im.height, " image");
  return out;
}

void write_png(const std::string& path, const Image& im) { write_bytes(path, encode_png(im)); }

std::vector<uint8_t> encode_jpeg(const Image& im, int quality) {
  check_writable(im, "encode_jpeg");
  KILN_CHECK(quality >= 1 && quality <= 100, "encode_jpeg: quality must be 1..100, got ", quality);
  std::vector<uint8_t> out;
  KILN_CHECK(stbi_write_jpg_to_func(append_bytes, &out, int(im.width), int(im.height),
                                    int(im.channels), im.pixels.data(), quality),
             "encode_jpeg: stb_image_write failed for a ", im.width, "x", im.height, " image");
  return out;
}

void write_jpeg(const std::string& path, const Image& im, int quality) {
  write_bytes(path, encode_jpeg(im, quality));
}

}  // namespace kiln::data
