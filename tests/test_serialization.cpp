// safetensors round trips, atomic writes, and errors on damaged files.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/json.h"
#include "core/serialization.h"
#include "tests/gradcheck.h"

using namespace kiln;
namespace fs = std::filesystem;

static std::string temp_path(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("kiln_test_ser_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return (dir / name).string();
}

TEST_CASE("safetensors round trip of every dtype, strided input, metadata") {
  std::string path = temp_path("a.safetensors");
  Tensor f = randn({3, 4});
  Tensor ft = f.t();  // non-contiguous: written contiguous
  Tensor d = randn({2, 2, 2}, DType::f64);
  Tensor h = randn({5}).to(DType::f16);
  Tensor b = randn({5}).to(DType::bf16);
  Tensor i = from_vector<int64_t>({1, -2, 3}, {3}, DType::i64);
  Tensor j = from_vector<int32_t>({7, 8}, {2}, DType::i32);
  Tensor u = from_vector<int>({0, 255}, {2}, DType::u8);
  Tensor z = from_vector<int>({1, 0, 1}, {3}, DType::boolean);
  save_safetensors(path, {{"ft", ft}, {"d", d}, {"h", h}, {"b", b}, {"i", i}, {"j", j}, {"u", u},
                          {"z", z}},
                   {{"epoch", "3"}, {"note", "quote\" and \\ backslash"}});
  SafetensorsData r = load_safetensors(path);
  REQUIRE(r.tensors.size() == 8);
  CHECK(r.tensors[0].first == "ft");
  CHECK(r.tensors[7].first == "z");
  CHECK(r.metadata.at("epoch") == "3");
  CHECK(r.metadata.at("note") == "quote\" and \\ backslash");
  KILN_CHECK_OK(testing::compare(r.at("ft"), ft, 0, 0));
  KILN_CHECK_OK(testing::compare(r.at("d"), d, 0, 0));
  CHECK(r.at("h").dtype() == DType::f16);
  CHECK(r.at("h").to_vector<float>() == h.to_vector<float>());
  CHECK(r.at("b").to_vector<float>() == b.to_vector<float>());
  CHECK(r.at("i").to_vector<int64_t>() == std::vector<int64_t>{1, -2, 3});
  CHECK(r.at("j").to_vector<int>() == std::vector<int>{7, 8});
  CHECK(r.at("u").to_vector<int>() == std::vector<int>{0, 255});
  CHECK(r.at("z").to_vector<int>() == std::vector<int>{1, 0, 1});
  CHECK_THROWS_AS(r.at("missing"), Error);
  // Data section alignment: header length is a multiple of 8.
  std::ifstream in(path, std::ios::binary);
  unsigned char len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  CHECK(len[0] % 8 == 0);
}

TEST_CASE("safetensors_host: this moment's values, joined later, the same bytes") {
  Tensor w = randn({4, 3});
  Tensor cl = randn({2, 3, 2, 2}).contiguous(MemoryFormat::ChannelsLast);  // written contiguous
  const NamedTensors ts{{"w", w}, {"cl", cl}};
  const std::string before = safetensors_bytes("x", ts, {{"k", "v"}});
  const SafetensorsHost host = safetensors_host("x", ts, {{"k", "v"}});
  // In-place updates after the snapshot (the next epoch's steps) must not reach it.
  w.fill_(7.0);
  cl.fill_(-1.0);
  CHECK(host.join() == before);
  CHECK(host.tensors[0].second.data<float>() != w.data<float>());
  CHECK(safetensors_bytes("x", ts, {{"k", "v"}}) != before);
  // The header is the file's first bytes: length prefix, JSON, padding to 8.
  CHECK(before.compare(0, host.header.size(), host.header) == 0);
  CHECK(host.header.size() % 8 == 0);
}

TEST_CASE("atomic write leaves no temp file and replaces the old file whole") {
  std::string path = temp_path("b.safetensors");
  save_safetensors(path, {{"x", ones({4})}});
  save_safetensors(path, {{"x", full({4}, 2.0)}});
  CHECK(load_safetensors(path).at("x").to_vector<float>() == std::vector<float>{2, 2, 2, 2});
  for (auto& e : fs::directory_iterator(fs::path(path).parent_path()))
    CHECK(e.path().string().find(".tmp.") == std::string::npos);
}

TEST_CASE("damaged files give errors naming the file") {
  std::string path = temp_path("c.safetensors");
  save_safetensors(path, {{"x", ones({100})}});
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  auto write = [&](const std::string& b) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << b;
  };
  auto expect_error = [&](const std::string& what) {
    CAPTURE(what);
    try {
      load_safetensors(path);
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find(path) != std::string::npos);
    }
  };
  write(bytes.substr(0, bytes.size() - 10));
  expect_error("truncated data");
  write(bytes.substr(0, 5));
  expect_error("shorter than the length field");
  std::string bad = bytes;
  bad[0] = char(0xff);
  bad[5] = char(0x7f);
  write(bad);
  expect_error("absurd header length");
  std::string garbage = bytes;
  garbage[8] = '#';  // the opening brace
  write(garbage);
  expect_error("malformed JSON");
  CHECK_THROWS_AS(load_safetensors(temp_path("does-not-exist.safetensors")), Error);
}

TEST_CASE("json parser") {
  json::Value v = json::parse(R"({"a": [1, 2.5, -3e2], "b": {"c": "x\ny"}, "t": true, "n": null})");
  CHECK(v.at("a").array()[2].number() == -300);
  CHECK(v.at("b").at("c").str() == "x\ny");
  CHECK(v.at("t").boolean());
  CHECK_THROWS_AS(json::parse("{\"a\": }"), Error);
  CHECK_THROWS_AS(json::parse("[1, 2"), Error);
  CHECK_THROWS_AS(v.at("zz"), Error);
  CHECK(json::quote("a\"b") == "\"a\\\"b\"");
}

// A crafted file: 8-byte length, `header` as given, then `data_bytes` zero bytes.
static void write_crafted(const std::string& path, const std::string& header, size_t data_bytes) {
  std::string b;
  const uint64_t hl = header.size();
  for (int i = 0; i < 8; ++i) b.push_back(char((hl >> (8 * i)) & 0xff));
  b += header;
  b.append(data_bytes, '\0');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << b;
}

// The message of load_safetensors' error (FAIL when it loads).
static std::string load_error(const std::string& path) {
  try {
    load_safetensors(path);
  } catch (const Error& e) {
    return e.what();
  }
  FAIL("no error");
  return "";
}

TEST_CASE("crafted safetensors headers: the spec's rules, messages name file and tensor") {
  const std::string path = temp_path("crafted.safetensors");
  auto expect = [&](const std::string& header, size_t data, const std::string& needle,
                    const std::string& tensor) {
    CAPTURE(header);
    write_crafted(path, header, data);
    const std::string msg = load_error(path);
    CAPTURE(msg);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find(needle) != std::string::npos);
    if (!tensor.empty()) CHECK(msg.find("'" + tensor + "'") != std::string::npos);
  };
  const std::string ok_x = R"("x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  write_crafted(path, "{" + ok_x + "}", 8);
  CHECK(load_safetensors(path).at("x").numel() == 2);

  // 2^62 * 4 elements overflow int64 (the old check wrapped to a small byte count).
  expect(R"({"big":{"dtype":"F32","shape":[4611686018427387904,1,2,2],"data_offsets":[0,16]}})", 16,
         "2^63", "big");
  expect(
      R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
      8, "duplicate key 'x'", "");
  expect(
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      12, "overlaps", "b");
  expect(
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
      12, "belong to no tensor", "b");
  expect("{" + ok_x + "}", 12, "at the end of the data section", "");
  expect(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0.0,8]}})", 8, "integers", "x");
  expect(R"({"x":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8, "integers", "x");
  expect(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "integers", "x");
  expect(R"({"x":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8, "integers", "x");
  expect(R"({"x":{"shape":[2],"data_offsets":[0,8]}})", 8, "no 'dtype'", "x");
  expect(R"({"x":{"dtype":"F32","data_offsets":[0,8]}})", 8, "no 'shape'", "x");
  expect(R"({"x":{"dtype":"F32","shape":[2]}})", 8, "no 'data_offsets'", "x");
  expect(R"({"x":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8, "unsupported dtype", "x");
  expect(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "12 needed", "x");
  expect(R"({"x":[1,2]})", 8, "not a JSON object", "x");
  expect(R"({"__metadata__":{"a":1},)" + ok_x + "}", 8, "__metadata__ 'a'", "");
  expect(R"(  {)" + ok_x + "}", 8, "must start with '{'", "");
  // Header length above the cap (the file is not that big: the size check would also catch a
  // lie, so make the file long enough to pass it... a sparse file keeps this cheap).
  {
    const uint64_t hl = kMaxSafetensorsHeader + 8;
    std::string b;
    for (int i = 0; i < 8; ++i) b.push_back(char((hl >> (8 * i)) & 0xff));
    b += "{}";
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out << b;
    }
    fs::resize_file(path, 8 + hl + 16);
    const std::string msg = load_error(path);
    CHECK(msg.find("exceeds the limit") != std::string::npos);
  }
}

TEST_CASE("load_safetensors refuses a FIFO and a folder without blocking") {
  const std::string fifo = temp_path("fifo.safetensors");
  fs::remove(fifo);
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::string msg = load_error(fifo);
  CHECK(msg.find("not a regular file") != std::string::npos);
  fs::remove(fifo);
  msg = load_error(fs::path(fifo).parent_path().string());
  CHECK(msg.find("not a regular file") != std::string::npos);
}

// The message of write_file_atomic's IoError (FAIL when it writes; another class of error fails
// the test case).
static std::string write_error(const std::string& path, const std::string& bytes) {
  try {
    write_file_atomic(path, bytes);
  } catch (const IoError& e) {
    return e.what();
  }
  FAIL("no IoError");
  return "";
}

static std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST_CASE("write_file_atomic replaces a regular file only; refusals are IoErrors naming the path") {
  const fs::path dir = temp_path("atomic");
  fs::remove_all(dir);
  fs::create_directories(dir);
  // No "<name>.tmp.<pid>" is left behind by a refusal.
  auto temporaries = [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir))
      n += e.path().filename().string().find(".tmp.") != std::string::npos;
    return n;
  };
  // A FIFO: renaming over it would replace a pipe some other program reads. The message is about
  // the user's file (IoError): no " [file.cpp:N" location.
  const fs::path fifo = dir / "out.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::string m = write_error(fifo.string(), "bytes");
  CHECK(m.rfind("'" + fifo.string() + "' exists and is not a regular file (a device, FIFO or "
                "socket); refusing to replace it", 0) == 0);
  CHECK(m.find(" [") == std::string::npos);
  CHECK(fs::is_fifo(fs::symlink_status(fifo)));
  // A folder, with what it holds.
  const fs::path folder = dir / "out.d";
  fs::create_directories(folder);
  std::ofstream(folder / "keep") << "kept";
  m = write_error(folder.string(), "bytes");
  CHECK(m.rfind("'" + folder.string() + "' exists and is not a regular file (a folder)", 0) == 0);
  CHECK(m.find(" [") == std::string::npos);
  CHECK(fs::is_directory(fs::symlink_status(folder)));
  CHECK(read_bytes(folder / "keep") == "kept");
  // A link to the FIFO is judged by what it points to: refused, the link left as it was.
  const fs::path fifo_link = dir / "fifo-link";
  fs::create_symlink(fifo, fifo_link);
  CHECK(write_error(fifo_link.string(), "bytes").find("is not a regular file") !=
        std::string::npos);
  CHECK(fs::is_symlink(fifo_link));
  CHECK(fs::is_fifo(fs::symlink_status(fifo)));
  CHECK(temporaries() == 0);

  // A link to a regular file: the link is replaced by a regular file; what it pointed to keeps
  // its bytes (never written through the link).
  const fs::path target = dir / "target.bin", link = dir / "link.bin";
  std::ofstream(target, std::ios::binary) << "the user's bytes";
  fs::create_symlink(target, link);
  write_file_atomic(link.string(), "new bytes");
  CHECK_FALSE(fs::is_symlink(link));
  CHECK(fs::is_regular_file(fs::symlink_status(link)));
  CHECK(read_bytes(link) == "new bytes");
  CHECK(read_bytes(target) == "the user's bytes");
  CHECK(temporaries() == 0);

  // A missing parent folder: the OS's refusal, naming the path and errno's text; nothing made.
  const fs::path lost = dir / "missing" / "out.bin";
  m = write_error(lost.string(), "bytes");
  CHECK(m.find("'" + lost.string() + "'") != std::string::npos);
  CHECK(m.find("No such file or directory") != std::string::npos);
  CHECK(m.find(" [") == std::string::npos);
  CHECK_FALSE(fs::exists(dir / "missing"));
  fs::remove_all(dir);
}

TEST_CASE("json: duplicate keys rejected, integer literals exact") {
  CHECK_THROWS_AS(json::parse(R"({"a": 1, "a": 2})"), Error);
  json::Value v = json::parse(R"([18446744073709551615, 9007199254740993, 1.0, -4, 1e3, 3])");
  const auto& a = v.array();
  CHECK(a[0].unsigned_integer() == 18446744073709551615ull);
  CHECK(a[1].unsigned_integer() == 9007199254740993ull);  // not representable as a double
  CHECK_FALSE(a[2].is_integer());
  CHECK(a[3].is_integer());
  CHECK_THROWS_AS(a[3].unsigned_integer(), Error);
  CHECK_FALSE(a[4].is_integer());
  CHECK(a[5].unsigned_integer() == 3);
}
