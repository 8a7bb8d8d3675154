#pragma once
// TEMPORARY (branch nn-models only): weak stand-ins for the F:: ops that other branches
// implement (conv2d, pooling, batch_norm, linear). The layers' vtables reference their
// forward(), so any test that constructs a layer needs these symbols to link. A weak definition
// in the test object never pulls the real op's archive member, and the real one wins if that
// member is linked for another reason. Suites that include this must not run forward passes
// through these layers. Delete this file and its #include lines once those branches are merged.
#include "core/error.h"
#include "ops/ops.h"

namespace kiln::F {
#define KILN_PENDING(op) KILN_FAIL("F::" op " is not implemented on this branch (tests/pending_ops.h)")
[[gnu::weak]] Tensor conv2d(const Tensor&, const Tensor&, const Tensor&, Pair, Pair, Pair, int64_t) {
  KILN_PENDING("conv2d");
}
[[gnu::weak]] Tensor max_pool2d(const Tensor&, Pair, std::optional<Pair>, Pair, Pair) {
  KILN_PENDING("max_pool2d");
}
[[gnu::weak]] Tensor avg_pool2d(const Tensor&, Pair, std::optional<Pair>, Pair, bool) {
  KILN_PENDING("avg_pool2d");
}
[[gnu::weak]] Tensor adaptive_avg_pool2d(const Tensor&, Pair) { KILN_PENDING("adaptive_avg_pool2d"); }
[[gnu::weak]] Tensor batch_norm(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, bool, double, double) {
  KILN_PENDING("batch_norm");
}
[[gnu::weak]] Tensor linear(const Tensor&, const Tensor&, const Tensor&) { KILN_PENDING("linear"); }
#undef KILN_PENDING
}  // namespace kiln::F
