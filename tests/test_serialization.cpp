// safetensors round trips, atomic writes, and errors on damaged files.
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

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
