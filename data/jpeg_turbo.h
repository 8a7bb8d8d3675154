#pragma once
// JPEG decoding with libjpeg-turbo (jpeglib.h) for the CPU input path: only the part of the image
// a crop needs is decoded (jpeg_crop_scanline for the columns, jpeg_skip_scanlines for the rows),
// and the DCT does a first 2x/4x/8x reduction when the crop is at least that much larger than
// the output. stb_image (data/image.h) stays the decoder for PNG and the fallback when kiln is
// built without libjpeg (jpeg_turbo_available() == false: every function here then throws).
//
//   JpegInfo info = read_jpeg_info(bytes.data(), bytes.size(), path);       // header only
//   CropBox box = random_resized_crop_box(info.height, info.width, gen);
//   decode_jpeg_resampled(bytes.data(), bytes.size(), path, to_box_f(box), box, 224, 224,
//                         flip, dst);                                        // dst (224, 224, 3)
//
// Colour: YCbCr/RGB -> RGB; grayscale -> R = G = B; CMYK/YCCK -> RGB as stb_image does it
// (Adobe's inverted CMYK: R = C * K / 255, ...). Errors (kiln::Error naming `name`): empty or
// non-JPEG data, corrupt or truncated data (libjpeg's corrupt-data warnings count as errors;
// only the harmless ones, such as extraneous bytes before a marker, are ignored), sizes over kMaxImageSide / kMaxImagePixels, unsupported colour spaces.
// libjpeg's fatal errors return through longjmp, never exit(). Thread-safe: each call has its
// own decompressor; scratch buffers are per thread.
#include <cstddef>
#include <cstdint>
#include <string>

#include "data/image.h"
#include "data/transforms.h"

namespace kiln::data {

// Whether kiln was built with libjpeg(-turbo).
bool jpeg_turbo_available();

// The JPEG start-of-image marker (FF D8 FF).
bool looks_like_jpeg(const uint8_t* data, size_t size);

struct JpegInfo {
  int64_t height = 0, width = 0;
  int components = 0;        // 1 (gray), 3 (YCbCr/RGB) or 4 (CMYK/YCCK)
  bool progressive = false;  // SOF2
  bool cmyk = false;         // 4 components (CMYK or YCCK)
  bool arithmetic = false;   // arithmetic-coded (SOF9-SOF11) instead of Huffman
  int precision = 8;         // bits per sample (12 in some extended files)
};
// Header only; checks the size guards. Without libjpeg, stb's probe: size and components only.
JpegInfo read_jpeg_info(const uint8_t* data, size_t size, const std::string& name);

// The whole image, RGB (height, width, 3), at full size (scale_denom 1) or reduced by the DCT
// (scale_denom 2, 4 or 8: ceil(side / denom) pixels a side). What tests compare with stb.
Image decode_jpeg(const uint8_t* data, size_t size, const std::string& name, int scale_denom = 1);

// The DCT reduction the resampled decode chooses for a `box` (source pixels) resampled to
// out_h x out_w: the largest of 8, 4, 2 with box.height >= denom * out_h and
// box.width >= denom * out_w, else 1.
int jpeg_scale_denom(BoxF box, int64_t out_h, int64_t out_w);

// dst (out_h, out_w, 3) = resample_box (data/transforms.h) of the decoded image with the same
// box, limit and flip — decoding only the rows and columns that the filter's taps reach, at the
// DCT reduction jpeg_scale_denom gives (the box and limit are mapped to the reduced image; when
// dct_scaling is false the image is decoded at full size). So the result differs from
// "stb decode + resample_box" only by the decoders' rounding, plus the DCT reduction's own
// filter when it is used (tests/test_jpeg_turbo.cpp measures both).
void decode_jpeg_resampled(const uint8_t* data, size_t size, const std::string& name, BoxF box,
                           CropBox limit, int64_t out_h, int64_t out_w, bool flip, uint8_t* dst,
                           bool dct_scaling = true);

}  // namespace kiln::data
