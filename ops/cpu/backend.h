#pragma once
// The CPU backend's face: its table of entry points (core/backend.h), filled by
// ops/cpu/backend.cpp from the kernels of ops/cpu/kernels.h. The reference every other backend
// is tested against. Registered by ops/backends.cpp.
#include "core/backend.h"

namespace kiln::cpu {

const Backend& backend_table();

}  // namespace kiln::cpu
