#include "data/jpeg_turbo.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

#ifdef KILN_WITH_LIBJPEG
#include <csetjmp>
#include <cstdio>  // jpeglib.h needs FILE

#include <jerror.h>
#include <jpeglib.h>
#endif

namespace kiln::data {

bool looks_like_jpeg(const uint8_t* data, size_t size) {
  return size >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF;
}

int jpeg_scale_denom(BoxF box, int64_t out_h, int64_t out_w) {
  for (int d : {8, 4, 2})
    if (box.height >= double(d * out_h) && box.width >= double(d * out_w)) return d;
  return 1;
}

#ifdef KILN_WITH_LIBJPEG

bool jpeg_turbo_available() { return true; }

namespace {

// libjpeg reports fatal errors through error_exit, which must not return: we jump back to the
// setjmp in decode_session. Everything that session touches after setjmp is plain data or an
// object created before it, so the jump skips no destructor.
struct ErrorMgr {
  jpeg_error_mgr pub;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void on_error(j_common_ptr c) {
  auto* e = reinterpret_cast<ErrorMgr*>(c->err);
  (*c->err->format_message)(c, e->message);
  longjmp(e->jump, 1);
}

// Warnings about the pixel data (a file that ends early, bad Huffman codes, a lost restart
// marker: libjpeg would go on with grey or garbage blocks) are errors for us, so such a file is
// skipped as stb would skip it. Harmless ones ("extraneous bytes before marker", unknown JFIF
// revision or Adobe transform, a bad ICC marker: common in real collections) are ignored.
void on_message(j_common_ptr c, int level) {
  if (level >= 0) return;  // trace messages
  switch (c->err->msg_code) {
    case JWRN_EXTRANEOUS_DATA:
    case JWRN_JFIF_MAJOR:
    case JWRN_ADOBE_XFORM:
    case JWRN_BOGUS_ICC:
      c->err->num_warnings++;
      return;
    default:
      on_error(c);
  }
}

// One decode: inputs, the planned region (rows [r0, r1), columns [c0, c1) of the image scaled
// by 1/denom) and the outputs. Plain data, filled before and after setjmp.
struct Session {
  // in
  bool header_only = false;
  bool dct_scaling = true;
  bool whole = false;  // decode everything at `denom` (decode_jpeg)
  int denom = 1;
  BoxF box;
  CropBox limit;
  int64_t out_h = 0, out_w = 0;
  // planned / out
  JpegInfo info;
  int64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;  // region actually decoded (c0/c1 after iMCU rounding)
  int64_t scaled_h = 0, scaled_w = 0;
  const char* guard = nullptr;  // a size-guard failure
};

int64_t floor_i(double v) { return int64_t(std::floor(v)); }
int64_t ceil_i(double v) { return int64_t(std::ceil(v)); }

// The region of the 1/denom image that resampling s.box into s.out_h x s.out_w can reach.
void plan_region(Session& s) {
  if (s.whole) {
    s.r0 = s.c0 = 0;
    s.r1 = s.scaled_h;
    s.c1 = s.scaled_w;
    return;
  }
  const double d = double(s.denom);
  const double top = s.box.top / d, left = s.box.left / d;
  const double h = s.box.height / d, w = s.box.width / d;
  const double sup_y = std::max(h / double(s.out_h), 1.0), sup_x = std::max(w / double(s.out_w), 1.0);
  // Chroma upsampling treats the first and last chroma samples of a crop as the image's edge, so
  // near a crop's sides libjpeg-turbo's rows differ from a whole decode (measured: up to 13
  // levels in the edge columns). The region therefore reaches 8 columns and 2 rows beyond the
  // filter's taps on every side (clamped to the image, whose own edges decode as a whole decode
  // does); the taps stay inside the limit when resampling.
  s.r0 = std::clamp<int64_t>(floor_i(top - sup_y - 1.0) - 2, 0, s.scaled_h - 1);
  s.r1 = std::clamp<int64_t>(ceil_i(top + h + sup_y + 1.0) + 2, s.r0 + 1, s.scaled_h);
  s.c0 = std::clamp<int64_t>(floor_i(left - sup_x - 1.0) - 8, 0, s.scaled_w - 1);
  s.c1 = std::clamp<int64_t>(ceil_i(left + w + sup_x + 1.0) + 8, s.c0 + 1, s.scaled_w);
}

// Runs libjpeg on data; on success `pixels` holds the region (r1 - r0, c1 - c0, channels) with
// channels = 4 for CMYK, else 3. On failure returns false with `message` set.
bool decode_session(const uint8_t* data, size_t size, Session& s, std::vector<uint8_t>& pixels,
                    char* message) {
  jpeg_decompress_struct cinfo;
  ErrorMgr err;
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = on_error;
  err.pub.emit_message = on_message;
  if (setjmp(err.jump)) {
    std::snprintf(message, JMSG_LENGTH_MAX, "%s", err.message);
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  s.info.height = cinfo.image_height;
  s.info.width = cinfo.image_width;
  s.info.components = cinfo.num_components;
  s.info.progressive = cinfo.progressive_mode;
  s.info.arithmetic = cinfo.arith_code;
  s.info.precision = cinfo.data_precision;
  s.info.cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  const bool known = cinfo.jpeg_color_space == JCS_GRAYSCALE ||
                     cinfo.jpeg_color_space == JCS_YCbCr || cinfo.jpeg_color_space == JCS_RGB ||
                     s.info.cmyk;
  if (!known)
    s.guard = "unsupported JPEG colour space";
  else if (s.info.height > kMaxImageSide || s.info.width > kMaxImageSide ||
           s.info.height * s.info.width > kMaxImagePixels)
    s.guard = "header claims a size over the limit";
  if (s.header_only || s.guard) {
    jpeg_destroy_decompress(&cinfo);
    return true;
  }
  if (!s.whole) s.denom = s.dct_scaling ? jpeg_scale_denom(s.box, s.out_h, s.out_w) : 1;
  cinfo.scale_num = 1;
  cinfo.scale_denom = unsigned(s.denom);
  cinfo.out_color_space = s.info.cmyk ? JCS_CMYK : JCS_RGB;
  cinfo.dct_method = JDCT_ISLOW;
  jpeg_start_decompress(&cinfo);
  s.scaled_h = cinfo.output_height;
  s.scaled_w = cinfo.output_width;
  plan_region(s);
  JDIMENSION xoff = JDIMENSION(s.c0), w = JDIMENSION(s.c1 - s.c0);
  if (int64_t(w) < s.scaled_w) jpeg_crop_scanline(&cinfo, &xoff, &w);
  s.c0 = xoff;
  s.c1 = int64_t(xoff) + int64_t(w);
  const int64_t ch = cinfo.output_components;
  pixels.resize(size_t((s.r1 - s.r0) * (s.c1 - s.c0) * ch));
  if (s.r0 > 0) jpeg_skip_scanlines(&cinfo, JDIMENSION(s.r0));
  while (int64_t(cinfo.output_scanline) < s.r1) {
    JSAMPROW row = pixels.data() + (int64_t(cinfo.output_scanline) - s.r0) * (s.c1 - s.c0) * ch;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  // Rows below the region are never decoded; destroying aborts the decompression.
  jpeg_destroy_decompress(&cinfo);
  return true;
}

// Runs a session, throwing kiln::Error naming the file on any failure.
void run(const uint8_t* data, size_t size, const std::string& name, Session& s,
         std::vector<uint8_t>& pixels) {
  KILN_CHECK(size > 0, "image '", name, "': empty file");
  KILN_CHECK(looks_like_jpeg(data, size), "image '", name, "': not a JPEG file");
  char message[JMSG_LENGTH_MAX] = {0};
  if (!decode_session(data, size, s, pixels, message))
    KILN_FAIL("image '", name, "': JPEG decoding failed (", message, ")");
  KILN_CHECK(!s.guard, "image '", name, "': ", s.guard ? s.guard : "", " (", s.info.width, "x",
             s.info.height, ", limits ", kMaxImageSide, " per side, ", kMaxImagePixels,
             " pixels)");
}

// CMYK rows (Adobe's inverted form, as libjpeg outputs it) to RGB in place, as stb does it.
void cmyk_to_rgb(std::vector<uint8_t>& px) {
  const size_t n = px.size() / 4;
  for (size_t i = 0; i < n; ++i) {
    const unsigned k = px[i * 4 + 3];
    for (int c = 0; c < 3; ++c) {
      const unsigned t = unsigned(px[i * 4 + size_t(c)]) * k + 128;
      px[i * 3 + size_t(c)] = uint8_t((t + (t >> 8)) >> 8);
    }
  }
  px.resize(n * 3);
}

}  // namespace

JpegInfo read_jpeg_info(const uint8_t* data, size_t size, const std::string& name) {
  Session s;
  s.header_only = true;
  std::vector<uint8_t> none;
  run(data, size, name, s, none);
  return s.info;
}

Image decode_jpeg(const uint8_t* data, size_t size, const std::string& name, int scale_denom) {
  KILN_CHECK(scale_denom == 1 || scale_denom == 2 || scale_denom == 4 || scale_denom == 8,
             "decode_jpeg: scale_denom must be 1, 2, 4 or 8, got ", scale_denom);
  Session s;
  s.whole = true;
  s.denom = scale_denom;
  Image im;
  run(data, size, name, s, im.pixels);
  if (s.info.cmyk) cmyk_to_rgb(im.pixels);
  im.height = s.r1 - s.r0;
  im.width = s.c1 - s.c0;
  im.channels = 3;
  return im;
}

void decode_jpeg_resampled(const uint8_t* data, size_t size, const std::string& name, BoxF box,
                           CropBox limit, int64_t out_h, int64_t out_w, bool flip, uint8_t* dst,
                           bool dct_scaling) {
  KILN_CHECK(out_h > 0 && out_w > 0 && box.height > 0 && box.width > 0 && limit.height > 0 &&
                 limit.width > 0,
             "decode_jpeg_resampled: bad box or output size for '", name, "'");
  Session s;
  s.box = box;
  s.limit = limit;
  s.out_h = out_h;
  s.out_w = out_w;
  s.dct_scaling = dct_scaling;
  thread_local std::vector<uint8_t> pixels;  // the region; reused across images
  run(data, size, name, s, pixels);
  KILN_CHECK(limit.top >= 0 && limit.left >= 0 && limit.top + limit.height <= s.info.height &&
                 limit.left + limit.width <= s.info.width,
             "decode_jpeg_resampled: limit outside the ", s.info.width, "x", s.info.height,
             " image '", name, "'");
  if (s.info.cmyk) cmyk_to_rgb(pixels);
  // Box and limit in the region's coordinates (the image scaled by 1/denom, shifted).
  const double d = double(s.denom);
  const BoxF rb{box.top / d - double(s.r0), box.left / d - double(s.c0), box.height / d,
                box.width / d};
  const int64_t rh = s.r1 - s.r0, rw = s.c1 - s.c0;
  const int64_t ly0 = std::clamp<int64_t>(floor_i(double(limit.top) / d) - s.r0, 0, rh - 1);
  const int64_t ly1 =
      std::clamp<int64_t>(ceil_i(double(limit.top + limit.height) / d) - s.r0, ly0 + 1, rh);
  const int64_t lx0 = std::clamp<int64_t>(floor_i(double(limit.left) / d) - s.c0, 0, rw - 1);
  const int64_t lx1 =
      std::clamp<int64_t>(ceil_i(double(limit.left + limit.width) / d) - s.c0, lx0 + 1, rw);
  resample_box(pixels.data(), rh, rw, 3, rb, CropBox{ly0, lx0, ly1 - ly0, lx1 - lx0}, dst, out_h,
               out_w, flip);
}

#else  // built without libjpeg

bool jpeg_turbo_available() { return false; }

// stb's header probe: size and components (progressive and CMYK are not told apart).
JpegInfo read_jpeg_info(const uint8_t* data, size_t size, const std::string& name) {
  const ImageInfo pi = probe_image(data, size, name);
  JpegInfo info;
  info.height = pi.height;
  info.width = pi.width;
  info.components = int(pi.channels);
  return info;
}
Image decode_jpeg(const uint8_t*, size_t, const std::string& name, int) {
  KILN_FAIL("image '", name, "': kiln was built without libjpeg-turbo");
}
void decode_jpeg_resampled(const uint8_t*, size_t, const std::string& name, BoxF, CropBox,
                           int64_t, int64_t, bool, uint8_t*, bool) {
  KILN_FAIL("image '", name, "': kiln was built without libjpeg-turbo");
}

#endif

}  // namespace kiln::data
