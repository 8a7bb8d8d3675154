// IDX reading (raw and gzipped), MNIST-style folders, error messages, real Fashion-MNIST.
#include <doctest/doctest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "data/fashion_mnist.h"
#include "data/idx.h"
#include "tests/test_util.h"

using namespace kiln;
using namespace kiln::data;
namespace fs = std::filesystem;
using kiln::testing::error_of;

namespace {

using Bytes = std::vector<unsigned char>;

// A fresh folder under the system temp dir, removed at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("kiln_test_idx_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

void put_u32(Bytes& b, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<unsigned char>(v >> s));
}

// Header + payload; the payload bytes are (i * 7 + 3) % 256.
Bytes idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims, size_t payload) {
  Bytes b;
  put_u32(b, magic);
  for (uint32_t d : dims) put_u32(b, d);
  for (size_t i = 0; i < payload; ++i) b.push_back(static_cast<unsigned char>((i * 7 + 3) % 256));
  return b;
}
size_t prod(const std::vector<uint32_t>& dims) {
  size_t n = 1;
  for (uint32_t d : dims) n *= d;
  return n;
}

void write_raw(const std::string& path, const Bytes& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  REQUIRE(f.good());
}
void write_gz(const std::string& path, const Bytes& b) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, b.data(), unsigned(b.size())) == int(b.size()));
  REQUIRE(gzclose(f) == Z_OK);
}
Bytes read_raw(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), {});
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("raw and gzipped IDX files read back, gzip detected by content") {
  TempDir dir;
  const std::vector<uint32_t> dims = {5, 3, 4};
  const Bytes img = idx_bytes(kIdxMagicU8Images, dims, prod(dims));
  const Bytes lab = idx_bytes(kIdxMagicU8Labels, {5}, 5);
  write_raw(dir / "img.idx", img);
  write_gz(dir / "img.idx.gz", img);
  write_gz(dir / "img_gz_without_suffix", img);
  write_raw(dir / "raw_named.gz", img);
  write_raw(dir / "lab.idx", lab);
  for (const char* name : {"img.idx", "img.idx.gz", "img_gz_without_suffix", "raw_named.gz"}) {
    CAPTURE(name);
    Tensor t = read_idx_images(dir / name);
    CHECK(t.dtype() == DType::u8);
    CHECK(t.shape() == Shape{5, 3, 4});
    std::vector<int> v = t.to_vector<int>();
    REQUIRE(v.size() == 60);
    for (size_t i = 0; i < v.size(); ++i) CHECK(v[i] == int((i * 7 + 3) % 256));
  }
  IdxPair p = read_idx_pair(dir / "img.idx.gz", dir / "lab.idx");
  CHECK(p.labels.shape() == Shape{5});
  CHECK(p.labels.to_vector<int>() == std::vector<int>{3, 10, 17, 24, 31});
}

TEST_CASE("read_idx: any u8 rank, empty data") {
  TempDir dir;
  write_gz(dir / "a4", idx_bytes(0x00000804, {2, 1, 2, 3}, 12));
  write_raw(dir / "a2", idx_bytes(0x00000802, {3, 2}, 6));
  write_raw(dir / "empty", idx_bytes(kIdxMagicU8Images, {0, 28, 28}, 0));
  CHECK(read_idx(dir / "a4").shape() == Shape{2, 1, 2, 3});
  CHECK(read_idx(dir / "a2").to_vector<int>() == std::vector<int>{3, 10, 17, 24, 31, 38});
  CHECK(read_idx_images(dir / "empty").shape() == Shape{0, 28, 28});
  // Not u8 (type 0x0D = f32): refused.
  write_raw(dir / "f32", idx_bytes(0x00000D01, {1}, 4));
  std::string msg = error_of([&] { read_idx(dir / "f32"); });
  CHECK(has(msg, dir / "f32"));
  CHECK(has(msg, "0x00000d01"));
}

TEST_CASE("missing file and directory: errors name the path") {
  TempDir dir;
  std::string msg = error_of([&] { read_idx_images(dir / "nope.gz"); });
  CHECK(has(msg, dir / "nope.gz"));
  CHECK(has(msg, "does not exist"));
  msg = error_of([&] { read_idx_images(dir.path.string()); });
  CHECK(has(msg, dir.path.string()));
  CHECK(has(msg, "directory"));
}

TEST_CASE("wrong magic: says found and expected, names the file") {
  TempDir dir;
  write_raw(dir / "labels", idx_bytes(kIdxMagicU8Labels, {4}, 4));
  write_gz(dir / "labels.gz", idx_bytes(kIdxMagicU8Labels, {4}, 4));
  for (const char* name : {"labels", "labels.gz"}) {
    std::string msg = error_of([&] { read_idx_images(dir / name); });
    CHECK(has(msg, dir / name));
    CHECK(has(msg, "0x00000801"));
    CHECK(has(msg, "0x00000803"));
  }
  write_raw(dir / "text", Bytes{'h', 'e', 'l', 'l', 'o', '\n'});
  std::string msg = error_of([&] { read_idx_labels(dir / "text"); });
  CHECK(has(msg, "0x68656c6c"));
  CHECK(has(msg, "0x00000801"));
}

TEST_CASE("truncated files: expected vs got bytes") {
  TempDir dir;
  Bytes img = idx_bytes(kIdxMagicU8Images, {10, 4, 4}, 160);
  Bytes cut(img.begin(), img.end() - 60);  // 100 of 160 data bytes
  write_raw(dir / "cut", cut);
  write_gz(dir / "cut.gz", cut);
  for (const char* name : {"cut", "cut.gz"}) {
    CAPTURE(name);
    std::string msg = error_of([&] { read_idx_images(dir / name); });
    CHECK(has(msg, dir / name));
    CHECK(has(msg, "truncated"));
    CHECK(has(msg, "need 160 bytes"));
    CHECK(has(msg, "got 100"));
  }
  // Cut inside the header.
  write_raw(dir / "head", Bytes(img.begin(), img.begin() + 10));
  std::string msg = error_of([&] { read_idx_images(dir / "head"); });
  CHECK(has(msg, dir / "head"));
  CHECK(has(msg, "expected 16 header bytes, got 10"));
  write_raw(dir / "tiny", Bytes{0, 0});
  CHECK(has(error_of([&] { read_idx_images(dir / "tiny"); }), "got 2"));
  // A gzip stream cut short (no gzip trailer): still an error naming the file.
  write_gz(dir / "full.gz", img);
  Bytes gz = read_raw(dir / "full.gz");
  write_raw(dir / "gzcut.gz", Bytes(gz.begin(), gz.begin() + long(gz.size() / 2)));
  msg = error_of([&] { read_idx_images(dir / "gzcut.gz"); });
  CHECK(has(msg, dir / "gzcut.gz"));
}

TEST_CASE("trailing bytes and corrupt gzip data are errors") {
  TempDir dir;
  Bytes img = idx_bytes(kIdxMagicU8Images, {2, 2, 2}, 8);
  img.push_back(9);
  write_raw(dir / "long", img);
  write_gz(dir / "long.gz", img);
  for (const char* name : {"long", "long.gz"}) {
    std::string msg = error_of([&] { read_idx_images(dir / name); });
    CHECK(has(msg, dir / name));
    CHECK(has(msg, "1 more"));
  }
  // Garbage after a valid gzip header: deflate data is invalid.
  Bytes bad = {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3};
  for (int i = 0; i < 64; ++i) bad.push_back(0xff);
  write_raw(dir / "bad.gz", bad);
  std::string msg = error_of([&] { read_idx_images(dir / "bad.gz"); });
  CHECK(has(msg, dir / "bad.gz"));
  CHECK(has(msg, "corrupt gzip"));
}

TEST_CASE("absurd header dims are refused before allocating") {
  TempDir dir;
  // Raw: 4e9 * 4e9 * 4e9 overflows; 1e5 x 1e4 x 1e4 = 1e13 bytes exceeds the file.
  write_raw(dir / "overflow",
            idx_bytes(kIdxMagicU8Images, {4000000000u, 4000000000u, 4000000000u}, 0));
  std::string msg = error_of([&] { read_idx_images(dir / "overflow"); });
  CHECK(has(msg, dir / "overflow"));
  CHECK(has(msg, "absurd"));
  write_raw(dir / "huge", idx_bytes(kIdxMagicU8Images, {100000, 10000, 10000}, 16));
  msg = error_of([&] { read_idx_images(dir / "huge"); });
  CHECK(has(msg, dir / "huge"));
  CHECK(has(msg, "need 10000000000000 bytes"));
  CHECK(has(msg, "got 16"));
  // Gzipped: a few dozen bytes cannot hold 1e13 bytes.
  write_gz(dir / "huge.gz", idx_bytes(kIdxMagicU8Images, {100000, 10000, 10000}, 16));
  msg = error_of([&] { read_idx_images(dir / "huge.gz"); });
  CHECK(has(msg, dir / "huge.gz"));
  CHECK(has(msg, "absurd"));
}

TEST_CASE("read_idx_pair: count mismatch names both files") {
  TempDir dir;
  write_raw(dir / "img", idx_bytes(kIdxMagicU8Images, {3, 2, 2}, 12));
  write_gz(dir / "lab.gz", idx_bytes(kIdxMagicU8Labels, {4}, 4));
  std::string msg = error_of([&] { read_idx_pair(dir / "img", dir / "lab.gz"); });
  CHECK(has(msg, dir / "img"));
  CHECK(has(msg, dir / "lab.gz"));
  CHECK(has(msg, "3 images"));
  CHECK(has(msg, "4 labels"));
}

TEST_CASE("load_mnist: MNIST file names, gzipped or not; missing files explain themselves") {
  TempDir dir;
  write_gz(dir / "train-images-idx3-ubyte.gz", idx_bytes(kIdxMagicU8Images, {6, 2, 3}, 36));
  write_gz(dir / "train-labels-idx1-ubyte.gz", idx_bytes(kIdxMagicU8Labels, {6}, 6));
  write_raw(dir / "t10k-images.idx3-ubyte", idx_bytes(kIdxMagicU8Images, {2, 2, 3}, 12));
  write_raw(dir / "t10k-labels-idx1-ubyte", idx_bytes(kIdxMagicU8Labels, {2}, 2));
  IdxPair train = load_mnist(dir.path.string(), Split::Train);
  IdxPair test = load_mnist(dir.path.string(), Split::Test);
  CHECK(train.images.shape() == Shape{6, 2, 3});
  CHECK(train.labels.shape() == Shape{6});
  CHECK(test.images.shape() == Shape{2, 2, 3});
  CHECK(test.labels.to_vector<int>() == std::vector<int>{3, 10});

  TempDir empty_dir;
  std::string msg = error_of([&] { load_fashion_mnist(empty_dir.path.string(), Split::Test); });
  CHECK(has(msg, empty_dir.path.string()));
  CHECK(has(msg, "t10k-images-idx3-ubyte.gz"));
  CHECK(has(msg, "apt-get install dataset-fashion-mnist"));
  CHECK(kFashionMnistClasses.size() == 10);
  CHECK(std::string(kFashionMnistClasses[9]) == "Ankle boot");
}

TEST_CASE("Fashion-MNIST from Debian's dataset-fashion-mnist, when installed") {
  if (!fs::exists(kFashionMnistDir)) {
    MESSAGE("skipped: ", kFashionMnistDir, " not found (apt-get install dataset-fashion-mnist)");
    return;
  }
  for (Split split : {Split::Train, Split::Test}) {
    IdxPair p = load_fashion_mnist(split);
    const int64_t n = split == Split::Train ? 60000 : 10000;
    CHECK(p.images.shape() == Shape{n, 28, 28});
    CHECK(p.labels.shape() == Shape{n});
    std::vector<int64_t> count(10, 0);
    bool in_range = true;
    for (int l : p.labels.to_vector<int>()) {
      if (l < 0 || l > 9)
        in_range = false;
      else
        count[size_t(l)]++;
    }
    CHECK(in_range);
    for (int64_t c : count) CHECK(c == n / 10);  // Fashion-MNIST is balanced
    std::vector<int> px = p.images.to_vector<int>();
    CHECK(*std::max_element(px.begin(), px.end()) == 255);
  }
}

TEST_CASE("labels: checked against the class count, stray labels named with file and index") {
  auto pair = [](std::vector<int> labels, const std::string& path) {
    data::IdxPair p;
    const int64_t n = int64_t(labels.size());
    p.labels = from_vector<int>(labels, {n}, DType::u8);
    p.images = zeros({n, 2, 2}, DType::u8);
    p.labels_path = path;
    return p;
  };
  // Every label below the largest occurs: that many classes (at least 10).
  CHECK(data::infer_num_classes(pair({0, 1, 2, 1}, "a")) == 10);
  std::vector<int> many;
  for (int i = 0; i < 12; ++i) many.push_back(11 - i);
  CHECK(data::infer_num_classes(pair(many, "b")) == 12);
  // A stray 255 among 0..9 does not make a 256-class model.
  std::vector<int> stray = {0, 1, 2, 3, 4, 255, 5, 6, 7, 8, 9};
  try {
    data::infer_num_classes(pair(stray, "/x/train-labels-idx1-ubyte"));
    FAIL("no error");
  } catch (const Error& e) {
    const std::string m = e.what();
    CHECK(m.find("/x/train-labels-idx1-ubyte") != std::string::npos);
    CHECK(m.find("label 255 at index 5") != std::string::npos);
  }
  // Test labels outside the training classes.
  data::check_labels(pair({0, 9, 3}, "t"), 10);
  try {
    data::check_labels(pair({0, 9, 10, 3}, "/x/t10k-labels-idx1-ubyte"), 10);
    FAIL("no error");
  } catch (const Error& e) {
    const std::string m = e.what();
    CHECK(m.find("/x/t10k-labels-idx1-ubyte") != std::string::npos);
    CHECK(m.find("label 10 at index 2") != std::string::npos);
  }
}
