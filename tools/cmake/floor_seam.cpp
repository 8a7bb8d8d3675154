// The floors' link check (CMakeLists.txt) links core/ alone. Core calls upward exactly once:
// its backend registry fills itself through register_builtin_backends, which ops/backends.cpp
// defines (the one place that knows which backends a build has; core/backend.h). This stand-in
// lets that single call resolve when core is linked alone; any other call from core into a
// floor above it still fails the link. Never part of libkiln.
#include "core/backend.h"

namespace kiln {

void register_builtin_backends(BackendRegistry&) {}

}  // namespace kiln
