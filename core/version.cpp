#include "core/version.h"

#include <cctype>
#include <string>

#ifdef KILN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kiln {

const char* version() { return KILN_VERSION; }

#ifdef KILN_WITH_CUDA
namespace {

// "80-real;90;120-virtual" -> "sm_80 sm_90, PTX compute_90 compute_120"; CMake's keywords as is.
std::string describe_archs(const std::string& archs) {
  std::string sass, ptx;
  size_t pos = 0;
  while (pos <= archs.size()) {
    const size_t semi = archs.find(';', pos);
    std::string item = archs.substr(pos, semi == std::string::npos ? semi : semi - pos);
    pos = semi == std::string::npos ? archs.size() + 1 : semi + 1;
    if (item.empty()) continue;
    bool real = true, virt = true;
    if (item.size() > 5 && item.compare(item.size() - 5, 5, "-real") == 0) {
      item.resize(item.size() - 5);
      virt = false;
    } else if (item.size() > 8 && item.compare(item.size() - 8, 8, "-virtual") == 0) {
      item.resize(item.size() - 8);
      real = false;
    }
    if (item.empty() || !std::isdigit(static_cast<unsigned char>(item[0]))) return archs;
    if (real) sass += (sass.empty() ? "sm_" : " sm_") + item;
    if (virt) ptx += (ptx.empty() ? "compute_" : " compute_") + item;
  }
  if (ptx.empty()) return sass;
  return sass.empty() ? "PTX " + ptx : sass + ", PTX " + ptx;
}

}  // namespace
#endif

std::string version_line(const std::string& tool) {
  std::string line = tool + " " + version() + " (";
#ifdef KILN_WITH_CUDA
  line += "CUDA " + std::to_string(CUDART_VERSION / 1000) + "." +
          std::to_string(CUDART_VERSION % 1000 / 10) + ", kernels for " +
          describe_archs(KILN_CUDA_ARCHITECTURES);
#ifdef KILN_WITH_NCCL
  line += ", NCCL";
#endif
#else
  line += "CPU only";
#endif
  return line + ")";
}

}  // namespace kiln
