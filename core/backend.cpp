#include "core/backend.h"

#include "core/error.h"

namespace kiln {
namespace {

const BackendRegistry& registry() {
  static const BackendRegistry r = [] {
    BackendRegistry reg;
    register_builtin_backends(reg);
    return reg;
  }();
  return r;
}

}  // namespace

bool has_backend(DeviceType type) { return registry().tables[size_t(type)] != nullptr; }

const Backend& backend(DeviceType type) {
  const Backend* b = registry().tables[size_t(type)];
  KILN_CHECK(b, "device type ", Device{type, 0}, " requested, but kiln was built without it");
  return *b;
}

OpProfileScope::OpProfileScope(const char* name, const Tensor& t) {
  if (!t.defined()) return;
  const Backend& b = backend(t);
  if (!b.profile_begin) return;
  backend_ = &b;
  token_ = b.profile_begin(name, t);
}

OpProfileScope::~OpProfileScope() {
  if (backend_) backend_->profile_end(token_);
}

}  // namespace kiln
