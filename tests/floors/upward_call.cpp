// A planted upward call: a file of core/ calling kiln::F (ops/). The test floors_refuse_upward_call
// links it with core's objects exactly as the floors' link check links core (CMakeLists.txt) and
// expects the linker to refuse it; never part of any real target.
#include "core/tensor.h"

namespace kiln {
namespace F {
Tensor relu(const Tensor& x);  // what a careless include of ops/ops.h would declare
}  // namespace F

Tensor planted_upward_call(const Tensor& x) { return F::relu(x); }

}  // namespace kiln
