// Version and build information (core/version.h), the light CUDA query and the compute-capability
// check kiln makes when it first uses a GPU (core/device_query.h).
#include <doctest/doctest.h>

#include <regex>

#include "core/device_query.h"
#include "core/version.h"

using namespace kiln;

TEST_CASE("version: library and headers agree; the tools' --version line") {
  CHECK(std::string(version()) == KILN_VERSION);
  CHECK(std::regex_match(std::string(version()), std::regex(R"(\d+\.\d+\.\d+)")));
  CHECK(std::string(KILN_VERSION) == std::to_string(KILN_VERSION_MAJOR) + "." +
                                         std::to_string(KILN_VERSION_MINOR) + "." +
                                         std::to_string(KILN_VERSION_PATCH));
  const std::string line = version_line("kiln-x");
  CHECK(line.rfind(std::string("kiln-x ") + KILN_VERSION + " (", 0) == 0);
#ifdef KILN_WITH_CUDA
  CHECK(built_with_cuda());
  CHECK(line.find("kernels for") != std::string::npos);
#else
  CHECK(!built_with_cuda());
  CHECK(line.find("CPU only") != std::string::npos);
  CHECK(cuda_device_count() == 0);
  CHECK(!cuda_available());
#endif
  CHECK(cuda_device_count() >= 0);
  CHECK(cuda_available() == (cuda_device_count() > 0));
}

TEST_CASE("cuda_arch_mismatch: which GPUs a list of CUDA architectures runs on") {
  const std::string all = "80-real;86-real;89-real;90-real;100-real;120";  // kiln's default
  auto runs = [](const std::string& archs, int major, int minor) {
    return cuda_arch_mismatch(archs, major, minor, "GPU").empty();
  };
  // A100, A10/RTX 30xx, Orin (8.7 runs 8.6's SASS), RTX 40xx, H100/H200, B200, B300 (10.3),
  // RTX 50xx, GB10 (12.1), and a future 13.0 through PTX 12.0.
  for (auto [major, minor] : {std::pair{8, 0}, {8, 6}, {8, 7}, {8, 9}, {9, 0}, {10, 0}, {10, 3},
                              {12, 0}, {12, 1}, {13, 0}}) {
    INFO(major << "." << minor);
    CHECK(runs(all, major, minor));
  }
  CHECK(!runs(all, 7, 5));   // Turing: below every entry
  CHECK(!runs(all, 11, 0));  // Thor: no 11.x SASS, and PTX 12.0 is newer than 11.0
  // Narrowed builds.
  CHECK(runs("90", 10, 0));           // PTX of 9.0 is compiled by the driver for 10.0
  CHECK(!runs("90-real", 10, 0));     // SASS of 9.0 runs on 9.x only
  CHECK(!runs("90-real", 8, 0));
  CHECK(runs("90a-real", 9, 0));      // arch-specific: exactly 9.0
  CHECK(!runs("90a", 10, 0));         // ... and no PTX that later GPUs could use
  CHECK(runs("86-virtual", 8, 9));
  CHECK(!runs("86-virtual", 8, 0));
  // Lists it cannot judge say nothing.
  CHECK(runs("native", 7, 5));
  CHECK(runs("all-major", 7, 5));
  CHECK(runs("", 7, 5));

  const std::string msg = cuda_arch_mismatch(all, 7, 5, "NVIDIA GeForce RTX 2080");
  CHECK(msg.find("NVIDIA GeForce RTX 2080") != std::string::npos);
  CHECK(msg.find("compute capability 7.5") != std::string::npos);
  CHECK(msg.find(all) != std::string::npos);
  CHECK(msg.find("-DCMAKE_CUDA_ARCHITECTURES=75") != std::string::npos);
  CHECK(msg.find('\n') == std::string::npos);  // one line
}
