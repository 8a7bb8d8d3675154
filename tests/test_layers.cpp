// The house's floors (README, Layout): every source file includes only files of its own floor
// or of the floors below it. Scans core/, cuda/, ops/, models/, data/, optim/, tools/ and
// tests/ (.h, .cpp, .cu, .cuh) for `#include "..."` and fails naming each upward or sideways
// include, with the file and line.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct Floor {
  const char* prefix;  // a folder of the repository, with its slash
  int level;
};
// Longest prefix first (ops/cpu/ before ops/). Floors of one level are neighbours that must not
// include each other (the two backends; models and data).
const Floor kFloors[] = {
    {"core/", 0},   {"cuda/", 1},  {"ops/cpu/", 1}, {"ops/", 2},   {"models/", 3},
    {"data/", 3},   {"optim/", 4}, {"tools/", 5},   {"tests/", 6},
};

const Floor* floor_of(const std::string& path) {
  for (const Floor& f : kFloors)
    if (path.rfind(f.prefix, 0) == 0) return &f;
  return nullptr;
}

// Empty when `file` (relative to the root) may include `target`, else why not.
std::string violation(const std::string& file, const std::string& target) {
  const Floor* from = floor_of(file);
  const Floor* to = floor_of(target);
  if (!from || !to || from == to) return {};
  if (to->level < from->level) return {};
  return std::string(to->level > from->level ? "upward" : "sideways") + " include: " + file +
         " (" + from->prefix + ", floor " + std::to_string(from->level) + ") includes " +
         target + " (" + to->prefix + ", floor " + std::to_string(to->level) + ")";
}

std::vector<std::string> scan(const fs::path& root) {
  std::vector<std::string> problems;
  const std::regex include_re(R"re(^\s*#\s*include\s+"([^"]+)")re");
  for (const Floor& f : kFloors) {
    const fs::path dir = root / f.prefix;
    if (!fs::exists(dir)) continue;
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      if (!e.is_regular_file()) continue;
      const std::string ext = e.path().extension().string();
      if (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh") continue;
      const std::string rel = fs::relative(e.path(), root).generic_string();
      if (floor_of(rel) != &f) continue;  // ops/cpu/ files belong to their own floor
      std::ifstream in(e.path());
      std::string line;
      int n = 0;
      while (std::getline(in, line)) {
        ++n;
        std::smatch m;
        if (!std::regex_search(line, m, include_re)) continue;
        const std::string why = violation(rel, m[1].str());
        if (!why.empty()) problems.push_back(why + " at line " + std::to_string(n));
      }
    }
  }
  return problems;
}

}  // namespace

TEST_CASE("the floor rule itself") {
  CHECK(violation("core/tensor.cpp", "core/storage.h").empty());
  CHECK(violation("ops/conv2d.cpp", "core/backend.h").empty());
  CHECK(violation("ops/backends.cpp", "cuda/backend.h").empty());
  CHECK(violation("ops/backends.cpp", "ops/cpu/backend.h").empty());
  CHECK(violation("tools/train/trainer.cpp", "data/loader.h").empty());
  CHECK_FALSE(violation("core/tensor.cpp", "ops/ops.h").empty());
  CHECK_FALSE(violation("cuda/kernels/normalize.cu", "data/loader.h").empty());
  CHECK_FALSE(violation("cuda/conv.cpp", "ops/cpu/kernels.h").empty());  // neighbours
  CHECK_FALSE(violation("ops/cpu/pool.cpp", "ops/ops.h").empty());
  CHECK_FALSE(violation("models/resnet.cpp", "data/loader.h").empty());
  CHECK_FALSE(violation("optim/amp.cpp", "tools/train/trainer.h").empty());
}

TEST_CASE("no file includes a file of a higher floor") {
  const char* src = std::getenv("KILN_SOURCE_DIR");
  REQUIRE_MESSAGE(src, "KILN_SOURCE_DIR is not set (ctest sets it)");
  const fs::path root(src);
  REQUIRE(fs::exists(root / "core" / "tensor.h"));
  const std::vector<std::string> problems = scan(root);
  for (const std::string& p : problems) INFO(p);
  std::string all;
  for (const std::string& p : problems) all += p + "\n";
  CHECK_MESSAGE(problems.empty(), all);
}
