#pragma once
// "Is there a GPU?" without CUDA's, cuDNN's or cuBLASLt's headers: safe to include anywhere, in
// CPU-only builds too (where the answers are "no" and 0). cuda/runtime.h has the full runtime.
//
//   if (kiln::cuda_available()) model->to(kiln::Device::cuda(0));
#include <string>

namespace kiln {

// Whether this kiln was built with the CUDA backend.
bool built_with_cuda();
// Number of CUDA devices this process can see (CUDA_VISIBLE_DEVICES applies); 0 in CPU-only
// builds, without a driver or without a device. Never throws. The first call asks the driver
// (which initialises it in this process); the answer is cached.
int cuda_device_count();
bool cuda_available();

// The check kiln makes when it first uses a device (cuda/runtime.cpp), as a pure function.
// `archs` is a CMAKE_CUDA_ARCHITECTURES list ("80-real;86-real;90;120-virtual": "-real" is
// machine code (SASS) only, "-virtual" PTX only, neither both; "90a" is SASS for exactly 9.0).
// SASS for X.y runs on X.z with z >= y; PTX for X.y is compiled by the driver for any device of
// capability >= X.y. Returns "" when some entry runs on a device of capability major.minor,
// else one line naming the device, what this kiln holds and what to rebuild with. Lists it cannot
// read (CMake's "native", "all", "all-major") give "" — nothing to say.
std::string cuda_arch_mismatch(const std::string& archs, int major, int minor,
                               const std::string& device_name);

}  // namespace kiln
