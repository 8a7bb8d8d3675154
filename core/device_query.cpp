#include "core/device_query.h"

#include <cctype>
#include <vector>

#ifdef KILN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kiln {

bool built_with_cuda() {
#ifdef KILN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef KILN_WITH_CUDA
  // Cached: the answer cannot change within a process, and probing a missing driver is slow.
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // not sticky; clear it so later calls start clean
      return 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

bool cuda_available() { return cuda_device_count() > 0; }

namespace {

struct ArchEntry {
  int cc = 0;             // 10 * major + minor
  bool sass = true;       // machine code
  bool ptx = true;        // PTX
  bool specific = false;  // "90a": SASS for exactly this capability
};

// "80-real" -> {80, sass}; false for anything else (CMake's keywords, typos).
bool parse_arch(std::string s, ArchEntry& e) {
  e = ArchEntry{};
  auto strip = [&](const std::string& suffix) {
    if (s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) {
      s.resize(s.size() - suffix.size());
      return true;
    }
    return false;
  };
  if (strip("-real"))
    e.ptx = false;
  else if (strip("-virtual"))
    e.sass = false;
  if (!s.empty() && (s.back() == 'a' || s.back() == 'f')) {
    e.specific = s.back() == 'a';
    s.pop_back();
  }
  if (s.size() < 2 || s.size() > 3) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  e.cc = std::stoi(s);
  return true;
}

}  // namespace

std::string cuda_arch_mismatch(const std::string& archs, int major, int minor,
                               const std::string& device_name) {
  const int cc = 10 * major + minor;
  std::vector<ArchEntry> entries;
  size_t pos = 0;
  while (pos <= archs.size()) {
    const size_t semi = archs.find(';', pos);
    const std::string item = archs.substr(pos, semi == std::string::npos ? semi : semi - pos);
    if (!item.empty()) {
      ArchEntry e;
      if (!parse_arch(item, e)) return "";  // not a list of numbers: cannot judge
      entries.push_back(e);
    }
    if (semi == std::string::npos) break;
    pos = semi + 1;
  }
  if (entries.empty()) return "";
  for (const ArchEntry& e : entries) {
    const bool sass_runs = e.sass && (e.specific ? e.cc == cc : e.cc / 10 == major && e.cc <= cc);
    const bool ptx_runs = e.ptx && !e.specific && e.cc <= cc;
    if (sass_runs || ptx_runs) return "";
  }
  const std::string mine = std::to_string(cc);
  return "this kiln has no GPU code for " + device_name + " (compute capability " +
         std::to_string(major) + "." + std::to_string(minor) +
         "; kiln was built for CUDA architectures " + archs +
         "): rebuild kiln with -DCMAKE_CUDA_ARCHITECTURES=" + mine + " (or add " + mine +
         " to the list)";
}

}  // namespace kiln
