// The one place that knows which backends this build has (core/backend.h): called once, by the
// first kiln::backend() call.
#include "core/backend.h"
#include "ops/cpu/backend.h"
#ifdef KILN_WITH_CUDA
#include "cuda/backend.h"
#endif

namespace kiln {

void register_builtin_backends(BackendRegistry& r) {
  r.tables[size_t(DeviceType::CPU)] = &cpu::backend_table();
#ifdef KILN_WITH_CUDA
  r.tables[size_t(DeviceType::CUDA)] = &cuda::backend_table();
#endif
}

}  // namespace kiln
