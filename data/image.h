#pragma once
// Image files: JPEG/PNG decoding to RGB u8 HWC (PNG with stb_image; JPEG with libjpeg-turbo where
// kiln has it, data/jpeg_turbo.h, else stb_image) and PNG/JPEG encoding (stb_image_write), with
// a size guard applied to the header before any pixel is decoded.
//
//   Image im = read_image("cat.jpg");        // im.pixels: height * width * 3 bytes, HWC, RGB
//   write_png("out.png", im);                // exact (lossless) round trip
//
// Every failure is a kiln::Error naming the file (or the `name` given for in-memory data) and
// stb's reason ("corrupt JPEG", "bad png sig", ...). Thread-safe: stb keeps its failure reason
// thread-local and decodes without global state.
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::data {

// Limits checked on the header before decoding: a forged header claiming a huge image is
// rejected instead of triggering a huge allocation.
inline constexpr int64_t kMaxImageSide = 16384;
inline constexpr int64_t kMaxImagePixels = 100'000'000;
// Default cap on an image file's size, checked (fstat) before a byte is read: a 5 GiB file
// named .jpg is refused with its name instead of exhausting memory. Real JPEG/PNG files under
// the pixel limit above are far smaller.
inline constexpr int64_t kMaxImageFileBytes = int64_t(256) << 20;

struct Image {
  int64_t height = 0;
  int64_t width = 0;
  int64_t channels = 3;         // 3 (RGB) from the decoder; 1 or 3 for the writers
  std::vector<uint8_t> pixels;  // (height, width, channels) row-major
};

// Decodes a JPEG or PNG held in memory to RGB (grayscale and alpha are converted; 16-bit PNG
// is reduced to 8 bits). `name` is used in error messages. Where kiln has libjpeg-turbo, all but
// PNGs go to it: stb_image's JPEG decoder reads out of bounds on some corrupt files (found by
// fuzzing; docs/lab/input-pipeline.md, 2026-12-05), so it sees JPEGs only in builds without
// libjpeg-turbo or through decode_image_stb. A PNG whose chunks claim more bytes than the file holds is refused
// before stb reads it.
Image decode_image(const uint8_t* data, size_t size, const std::string& name);
// stb_image for both formats, as asked for by name (ImageLoader's JpegDecoder::Stb, kiln-train
// --decoder stb; comparisons with libjpeg-turbo). Trust it with JPEGs from a known source only.
Image decode_image_stb(const uint8_t* data, size_t size, const std::string& name);
// Reads and decodes the file at `path` (at most max_bytes long).
Image read_image(const std::string& path, int64_t max_bytes = kMaxImageFileBytes);
// The whole file as bytes. kiln::Error naming the path when it cannot be read, is not a regular
// file (a FIFO is refused without blocking) or is longer than max_bytes (checked before reading).
std::vector<uint8_t> read_file_bytes(const std::string& path,
                                     int64_t max_bytes = kMaxImageFileBytes);
// The same into `out` (resized to the file's size; its capacity is reused, so a loader worker
// reading one file after another allocates only when a file is larger than any before).
void read_file_into(const std::string& path, std::vector<uint8_t>& out,
                    int64_t max_bytes = kMaxImageFileBytes);

// Header-only probe: width/height/channels of a JPEG or PNG without decoding it. A header whose
// sides stb will not read (over STBI_MAX_DIMENSIONS) fails with decode_image's size message
// ("header claims 60000x60000 pixels, over the limit ...") rather than stb's reason.
struct ImageInfo {
  int64_t height = 0, width = 0, channels = 0;
};
ImageInfo probe_image(const uint8_t* data, size_t size, const std::string& name);
// stb's probe for both formats (decode_image_stb's).
ImageInfo probe_image_stb(const uint8_t* data, size_t size, const std::string& name);

// Encodes `im` (channels 1 or 3) and writes it to `path` (overwriting). JPEG quality 1..100.
void write_png(const std::string& path, const Image& im);
void write_jpeg(const std::string& path, const Image& im, int quality = 90);
std::vector<uint8_t> encode_png(const Image& im);
std::vector<uint8_t> encode_jpeg(const Image& im, int quality = 90);  // baseline (stb_image_write)

}  // namespace kiln::data
