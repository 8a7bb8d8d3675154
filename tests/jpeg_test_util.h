#pragma once
// JPEG files stb_image_write cannot make (progressive, CMYK), written with libjpeg for the
// decoder suites. Only where the test target is built with KILN_WITH_LIBJPEG (CMakeLists.txt).
#ifdef KILN_WITH_LIBJPEG
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <jpeglib.h>

#include "data/image.h"

namespace kiln::testing {

// `im` (RGB, or grayscale with channels == 1) as a JPEG: baseline or progressive (arithmetic:
// arithmetic-coded instead of Huffman); or, with cmyk, a 4-component Adobe CMYK file
// whose stored (inverted) values are c = r, m = g, y = b, k = 230, so that a decoder applying
// R = C * K / 255 gives r * 230 / 255.
inline std::vector<uint8_t> libjpeg_encode(const data::Image& im, int quality, bool progressive,
                                           bool cmyk = false, bool arithmetic = false) {
  const int64_t h = im.height, w = im.width;
  std::vector<uint8_t> px;
  if (cmyk) {
    px.resize(size_t(h * w * 4));
    for (int64_t i = 0; i < h * w; ++i) {
      for (int c = 0; c < 3; ++c) px[size_t(i * 4 + c)] = im.pixels[size_t(i * 3 + c)];
      px[size_t(i * 4 + 3)] = 230;
    }
  }
  jpeg_compress_struct c;
  jpeg_error_mgr err;
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* out = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &out, &size);
  c.image_width = JDIMENSION(w);
  c.image_height = JDIMENSION(h);
  const bool gray = im.channels == 1;
  c.input_components = cmyk ? 4 : gray ? 1 : 3;
  c.in_color_space = cmyk ? JCS_CMYK : gray ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  if (progressive) jpeg_simple_progression(&c);
  if (arithmetic) c.arith_code = TRUE;
  jpeg_start_compress(&c, TRUE);
  const int ch = c.input_components;
  const uint8_t* base = cmyk ? px.data() : im.pixels.data();
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(base) + size_t(c.next_scanline) * size_t(w) * size_t(ch);
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  std::vector<uint8_t> bytes(out, out + size);
  jpeg_destroy_compress(&c);
  std::free(out);
  return bytes;
}

}  // namespace kiln::testing
#endif
