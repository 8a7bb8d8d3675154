#include "core/tensor.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <numeric>

#include "core/autograd.h"
#include "core/generator.h"
#include "core/backend.h"

namespace kiln {

// ---------------- shapes ----------------

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size(), 1);
  for (int64_t i = int64_t(shape.size()) - 2; i >= 0; --i)
    st[size_t(i)] = st[size_t(i) + 1] * std::max<int64_t>(shape[size_t(i) + 1], 1);
  return st;
}

Shape channels_last_strides(const Shape& s) {
  KILN_CHECK(s.size() == 4, "channels-last layout needs a 4-D shape, got ", shape_str(s));
  const int64_t C = std::max<int64_t>(s[1], 1), H = std::max<int64_t>(s[2], 1),
                W = std::max<int64_t>(s[3], 1);
  return {H * W * C, 1, W * C, C};
}

static int64_t wrap_dim(int64_t d, int64_t ndim, const char* op) {
  int64_t n = std::max<int64_t>(ndim, 1);
  KILN_CHECK(d >= -n && d < n, op, ": dim ", d, " out of range for a ", ndim, "-D tensor");
  return d < 0 ? d + n : d;
}

// For ops that index an existing dim: unlike wrap_dim, a 0-d tensor has none.
static int64_t wrap_existing_dim(int64_t d, int64_t ndim, const char* op) {
  KILN_CHECK(ndim > 0, op, ": dim ", d, " given for a 0-d tensor, which has no dims");
  return wrap_dim(d, ndim, op);
}

static void check_shape(const Shape& shape, const char* op) {
  for (int64_t d : shape)
    KILN_CHECK(d >= 0, op, ": negative dimension in shape ", shape_str(shape));
}

// ---------------- metadata ----------------

int64_t Tensor::size(int64_t d) const {
  return shape()[size_t(wrap_existing_dim(d, dim(), "size"))];
}
int64_t Tensor::stride(int64_t d) const {
  return strides()[size_t(wrap_existing_dim(d, dim(), "stride"))];
}

static bool strides_match(const Shape& shape, const Shape& strides, const Shape& want) {
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] != 1 && strides[i] != want[i]) return false;
  return true;
}

bool Tensor::is_contiguous(MemoryFormat fmt) const {
  if (fmt == MemoryFormat::ChannelsLast) {
    if (dim() != 4) return false;
    if (numel() == 0) return true;
    return strides_match(shape(), strides(), channels_last_strides(shape()));
  }
  if (numel() == 0) return true;  // no element to be out of place (as in PyTorch)
  return strides_match(shape(), strides(), contiguous_strides(shape()));
}

MemoryFormat Tensor::suggest_memory_format() const {
  if (dim() != 4 || !is_contiguous(MemoryFormat::ChannelsLast)) return MemoryFormat::Contiguous;
  if (!is_contiguous()) return MemoryFormat::ChannelsLast;
  // Dense in both layouts: the exact strides tell which one the tensor was made in.
  const Shape cl = channels_last_strides(shape());
  return strides() == cl && cl != contiguous_strides(shape()) ? MemoryFormat::ChannelsLast
                                                              : MemoryFormat::Contiguous;
}

std::string Tensor::desc() const {
  if (!defined()) return "undefined";
  std::string s = std::string(dtype_name(dtype())) + shape_str() + " " + device().str();
  if (dim() == 4 && suggest_memory_format() == MemoryFormat::ChannelsLast) s += " NHWC";
  return s;
}

void* Tensor::raw_data() const {
  return static_cast<char*>(storage()->data()) + impl().offset * int64_t(element_size());
}

double Tensor::item() const {
  KILN_CHECK(numel() == 1, "item() needs a one-element tensor, got ", desc());
  return to_vector<double>()[0];
}

// ---------------- autograd accessors ----------------

AutogradMeta& Tensor::autograd_meta() const {
  auto& im = impl();
  if (!im.autograd) im.autograd = std::make_unique<AutogradMeta>();
  return *im.autograd;
}

const std::shared_ptr<Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<Node> none;
  return (impl_ && impl_->autograd) ? impl_->autograd->grad_fn : none;
}

const Tensor& Tensor::set_requires_grad(bool r) const {
  KILN_CHECK(is_leaf(), "set_requires_grad: only leaf tensors can change requires_grad (",
             desc(), " was produced by ", grad_fn()->name(), ")");
  KILN_CHECK(!r || is_floating(dtype()), "set_requires_grad: only floating tensors can require "
             "grad, got ", desc());
  autograd_meta().requires_grad = r;
  return *this;
}

Tensor Tensor::grad() const {
  if (!impl_ || !impl_->autograd || !impl_->autograd->grad) return Tensor();
  return Tensor(impl_->autograd->grad);
}

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined()) {
    KILN_CHECK(g.shape() == shape() && g.dtype() == dtype() && g.device() == device(),
               "set_grad: gradient ", g.desc(), " does not match tensor ", desc());
  }
  autograd_meta().grad = g.impl_ptr();
}

void Tensor::backward(const Tensor& gradient, bool retain_graph) const {
  autograd::backward({*this}, {gradient}, retain_graph);
}

Tensor Tensor::detach() const {
  auto im = std::make_shared<TensorImpl>();
  im->storage = storage();
  im->offset = offset();
  im->shape = shape();
  im->strides = strides();
  im->dtype = dtype();
  im->device = device();
  return Tensor(im);
}

// ---------------- views ----------------

static Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  return make_tensor(base.storage(), offset, std::move(shape), std::move(strides), base.dtype());
}

static Shape infer_shape(Shape shape, int64_t numel, const char* op, const Tensor& t) {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      KILN_CHECK(infer < 0, op, ": only one dimension can be -1, got ", shape_str(shape));
      infer = int64_t(i);
    } else {
      KILN_CHECK(shape[i] >= 0, op, ": invalid size in ", shape_str(shape));
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    KILN_CHECK(known > 0 && numel % known == 0, op, ": shape ", shape_str(shape),
               " is invalid for input ", t.desc());
    shape[size_t(infer)] = numel / known;
  }
  KILN_CHECK(shape_numel(shape) == numel, op, ": shape ", shape_str(shape),
             " is invalid for input ", t.desc());
  return shape;
}

Tensor Tensor::view(const Shape& new_shape) const {
  Shape s = infer_shape(new_shape, numel(), "view", *this);
  KILN_CHECK(is_contiguous(), "view: input ", desc(),
             " is not contiguous; use reshape (which copies)");
  Tensor out = make_view(*this, s, contiguous_strides(s), offset());
  Shape in_shape = shape();
  autograd::record_unary("ViewBackward", *this, out,
                         [in_shape](const Tensor& g) { return g.reshape(in_shape); });
  return out;
}

Tensor Tensor::reshape(const Shape& new_shape) const {
  if (is_contiguous()) return view(new_shape);
  return contiguous().view(new_shape);
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  int64_t s = wrap_dim(start_dim, dim(), "flatten"), e = wrap_dim(end_dim, dim(), "flatten");
  KILN_CHECK(s <= e, "flatten: start_dim ", start_dim, " after end_dim ", end_dim, " for ", desc());
  Shape ns;
  for (int64_t i = 0; i < s; ++i) ns.push_back(size(i));
  int64_t m = 1;
  for (int64_t i = s; i <= e; ++i) m *= size(i);
  ns.push_back(m);
  for (int64_t i = e + 1; i < dim(); ++i) ns.push_back(size(i));
  return reshape(ns);
}

Tensor Tensor::permute(const std::vector<int64_t>& dims) const {
  KILN_CHECK(int64_t(dims.size()) == dim(), "permute: got ", dims.size(), " dims for ", desc());
  std::vector<int64_t> p(dims.size());
  std::vector<bool> seen(dims.size(), false);
  Shape ns(dims.size()), nst(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], dim(), "permute");
    KILN_CHECK(!seen[size_t(d)], "permute: repeated dim ", dims[i]);
    seen[size_t(d)] = true;
    p[i] = d;
    ns[i] = shape()[size_t(d)];
    nst[i] = strides()[size_t(d)];
  }
  Tensor out = make_view(*this, ns, nst, offset());
  std::vector<int64_t> inv(p.size());
  for (size_t i = 0; i < p.size(); ++i) inv[size_t(p[i])] = int64_t(i);
  autograd::record_unary("PermuteBackward", *this, out,
                         [inv](const Tensor& g) { return g.permute(inv); });
  return out;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  if (dim() == 0) {  // dims 0 and -1 of a 0-d tensor: nothing to swap
    wrap_dim(d0, 0, "transpose");
    wrap_dim(d1, 0, "transpose");
    return permute({});
  }
  std::vector<int64_t> p(static_cast<size_t>(dim()));
  std::iota(p.begin(), p.end(), 0);
  std::swap(p[size_t(wrap_dim(d0, dim(), "transpose"))], p[size_t(wrap_dim(d1, dim(), "transpose"))]);
  return permute(p);
}

Tensor Tensor::t() const {
  KILN_CHECK(dim() <= 2, "t: expects a tensor with <= 2 dims, got ", desc(), "; use transpose");
  return dim() < 2 ? transpose(0, 0) : transpose(0, 1);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  d = wrap_existing_dim(d, dim(), "slice");
  KILN_CHECK(step > 0, "slice: step must be positive, got ", step);
  const int64_t n = shape()[size_t(d)];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape ns = shape(), nst = strides();
  ns[size_t(d)] = (end - start + step - 1) / step;
  nst[size_t(d)] *= step;
  Tensor out = make_view(*this, ns, nst, offset() + start * strides()[size_t(d)]);
  Shape in_shape = shape();
  autograd::record_unary("SliceBackward", *this, out, [=](const Tensor& g) {
    Tensor gi = zeros(in_shape, TensorOptions(g.dtype()).with_device(g.device()));
    NoGradGuard ng;
    gi.slice(d, start, end, step).copy_(g);
    return gi;
  });
  return out;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_existing_dim(d, dim(), "narrow");
  KILN_CHECK(start >= 0 && length >= 0 && start + length <= size(d), "narrow: [", start, ", ",
             start + length, ") out of range for dim ", d, " of ", desc());
  return slice(d, start, start + length);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_existing_dim(d, dim(), "select");
  int64_t n = size(d);
  KILN_CHECK(index >= -n && index < n, "select: index ", index, " out of range for dim ", d,
             " of ", desc());
  if (index < 0) index += n;
  return narrow(d, index, 1).squeeze(d);
}

Tensor Tensor::squeeze(std::optional<int64_t> d) const {
  Shape ns, nst;
  std::optional<int64_t> wd;
  if (d) wd = wrap_dim(*d, dim(), "squeeze");
  for (int64_t i = 0; i < dim(); ++i) {
    bool drop = shape()[size_t(i)] == 1 && (!wd || *wd == i);
    if (!drop) {
      ns.push_back(shape()[size_t(i)]);
      nst.push_back(strides()[size_t(i)]);
    }
  }
  Tensor out = make_view(*this, ns, nst, offset());
  Shape in_shape = shape();
  autograd::record_unary("SqueezeBackward", *this, out,
                         [in_shape](const Tensor& g) { return g.reshape(in_shape); });
  return out;
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape ns = shape(), nst = strides();
  int64_t st = (d < dim()) ? strides()[size_t(d)] * shape()[size_t(d)] : 1;
  ns.insert(ns.begin() + d, 1);
  nst.insert(nst.begin() + d, st);
  Tensor out = make_view(*this, ns, nst, offset());
  Shape in_shape = shape();
  autograd::record_unary("UnsqueezeBackward", *this, out,
                         [in_shape](const Tensor& g) { return g.reshape(in_shape); });
  return out;
}

// ---------------- copies and conversions ----------------

Tensor Tensor::contiguous(MemoryFormat fmt) const {
  if (is_contiguous(fmt)) return *this;
  return clone(fmt);
}

Tensor Tensor::clone(std::optional<MemoryFormat> fmt) const {
  MemoryFormat f = fmt ? *fmt : suggest_memory_format();
  Tensor out = empty(shape(), TensorOptions(dtype()).with_device(device()).with_memory_format(f));
  out.copy_(*this);
  autograd::record_unary("CloneBackward", *this, out, [](const Tensor& g) { return g; });
  return out;
}

Tensor Tensor::to(DType t) const {
  if (t == dtype()) return *this;
  Tensor out = empty(shape(), TensorOptions(t).with_device(device())
                                  .with_memory_format(suggest_memory_format()));
  out.copy_(*this);
  if (is_floating(t)) {
    DType in = dtype();
    autograd::record_unary("ToDTypeBackward", *this, out,
                           [in](const Tensor& g) { return g.to(in); });
  }
  return out;
}

Tensor Tensor::to(Device d) const {
  if (d == device()) return *this;
  Tensor out =
      empty(shape(), TensorOptions(dtype()).with_device(d).with_memory_format(suggest_memory_format()));
  out.copy_(*this);
  Device in = device();
  autograd::record_unary("ToDeviceBackward", *this, out,
                         [in](const Tensor& g) { return g.to(in); });
  return out;
}

namespace detail {

void copy_cpu(const Tensor& dst, const Tensor& src) {
  dispatch_all(dst.dtype(), [&]<typename D>() {
    D* dp = static_cast<D*>(dst.raw_data());
    dispatch_all(src.dtype(), [&]<typename S>() {
      const S* sp = static_cast<const S*>(src.raw_data());
      for_each_offset(dst.shape(), dst.strides(), src.strides(),
                      [&](int64_t od, int64_t os) { dp[od] = convert<D>(sp[os]); });
    });
  });
}

void fill_cpu(const Tensor& dst, double value) {
  dispatch_all(dst.dtype(), [&]<typename D>() {
    D* dp = static_cast<D*>(dst.raw_data());
    const D v = convert<D>(value);
    for_each_offset(dst.shape(), dst.strides(), dst.strides(), [&](int64_t o, int64_t) { dp[o] = v; });
  });
}

}  // namespace detail

Tensor Tensor::broadcast_to(const Shape& target) const {
  KILN_CHECK(int64_t(target.size()) >= dim(), "broadcast_to: target ", kiln::shape_str(target),
             " has fewer dims than ", desc());
  const size_t lead = target.size() - size_t(dim());
  Shape ns(target.size()), nst(target.size());
  for (size_t i = 0; i < target.size(); ++i) {
    if (i < lead) {
      KILN_CHECK(target[i] >= 0, "broadcast_to: -1 not allowed in a new leading dim");
      ns[i] = target[i];
      nst[i] = 0;
      continue;
    }
    int64_t cur = shape()[i - lead];
    int64_t want = target[i] == -1 ? cur : target[i];
    KILN_CHECK(want >= 0, "broadcast_to: invalid size ", target[i], " in ", kiln::shape_str(target));
    KILN_CHECK(cur == want || cur == 1, "broadcast_to: cannot expand ", desc(), " to ",
               kiln::shape_str(target));
    ns[i] = want;
    nst[i] = (cur == want) ? strides()[i - lead] : 0;
  }
  return make_tensor(storage(), offset(), ns, nst, dtype());
}

const Tensor& Tensor::copy_(const Tensor& src) const {
  KILN_CHECK(src.defined(), "copy_: source is undefined");
  if (is_same(src)) return *this;
  autograd::check_inplace(*this, "copy_");
  Tensor s = src.detach();
  if (s.shape() != shape()) s = s.broadcast_to(shape());
  // Source and destination in one buffer through different layouts (x.copy_(x.t()), shifted
  // narrows): the loop would read elements it already overwrote. Copy from a snapshot.
  if (s.shares_storage(*this) && (s.offset() != offset() || s.strides() != strides()))
    s = s.clone();
  bump_version();
  // The device side's backend copies between its device and the host.
  backend(is_cpu() ? s.device() : device()).copy(*this, s);
  return *this;
}

const Tensor& Tensor::fill_(double value) const {
  autograd::check_inplace(*this, "fill_");
  bump_version();
  backend(device()).fill(*this, value);
  return *this;
}

// ---------------- printing ----------------

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  if (!t.defined()) return os << "tensor(undefined)";
  const int64_t n = t.numel();
  constexpr int64_t kMaxShown = 200;
  std::vector<double> v;
  if (n <= kMaxShown) v = t.to_vector<double>();
  os << "tensor(";
  if (n > kMaxShown) {
    os << "...";
  } else if (n == 0) {
    os << "[]";
  } else if (t.dim() == 0) {
    os << v[0];
  } else {
    // Nested brackets, row-major.
    const Shape& s = t.shape();
    std::vector<int64_t> idx(s.size(), 0);
    auto old_prec = os.precision(6);
    for (int64_t i = 0; i < n; ++i) {
      // open brackets for dims whose index restarted
      size_t open = s.size();
      while (open > 0 && idx[open - 1] == 0) --open;
      for (size_t k = open; k < s.size(); ++k) os << "[";
      os << v[size_t(i)];
      // advance odometer, closing brackets
      size_t d = s.size();
      while (d > 0) {
        if (++idx[d - 1] < s[d - 1]) break;
        idx[d - 1] = 0;
        os << "]";
        --d;
      }
      if (i + 1 < n) os << ", ";
    }
    os.precision(old_prec);
  }
  os << ", " << t.desc();
  if (t.requires_grad()) os << ", requires_grad";
  return os << ")";
}

// ---------------- factories ----------------

Tensor make_tensor(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, Shape strides,
                   DType dtype) {
  auto im = std::make_shared<TensorImpl>();
  im->device = storage->device();
  im->storage = std::move(storage);
  im->offset = offset;
  im->shape = std::move(shape);
  im->strides = std::move(strides);
  im->dtype = dtype;
  return Tensor(im);
}

Tensor empty(const Shape& shape, TensorOptions opts) {
  check_shape(shape, "empty");
  Shape st = opts.memory_format == MemoryFormat::ChannelsLast ? channels_last_strides(shape)
                                                              : contiguous_strides(shape);
  auto storage =
      std::make_shared<Storage>(size_t(shape_numel(shape)) * dtype_size(opts.dtype), opts.device);
  Tensor t = make_tensor(std::move(storage), 0, shape, std::move(st), opts.dtype);
  if (opts.requires_grad) t.set_requires_grad(true);
  return t;
}

static TensorOptions like(const Tensor& t) {
  return TensorOptions(t.dtype()).with_device(t.device()).with_memory_format(t.suggest_memory_format());
}

Tensor empty_like(const Tensor& t) { return empty(t.shape(), like(t)); }

Tensor full(const Shape& shape, double value, TensorOptions opts) {
  bool rg = opts.requires_grad;
  Tensor t = empty(shape, opts.with_requires_grad(false));
  t.fill_(value);
  if (rg) t.set_requires_grad(true);
  return t;
}
Tensor zeros(const Shape& shape, TensorOptions opts) { return full(shape, 0.0, opts); }
Tensor ones(const Shape& shape, TensorOptions opts) { return full(shape, 1.0, opts); }
Tensor full_like(const Tensor& t, double v) { return full(t.shape(), v, like(t)); }
Tensor zeros_like(const Tensor& t) { return full_like(t, 0.0); }
Tensor ones_like(const Tensor& t) { return full_like(t, 1.0); }

Tensor arange(double start, double end, double step, TensorOptions opts) {
  KILN_CHECK(step != 0, "arange: step must be non-zero");
  KILN_CHECK(std::isfinite(start) && std::isfinite(end) && std::isfinite(step),
             "arange: start ", start, ", end ", end, " and step ", step, " must be finite");
  int64_t n = std::max<int64_t>(0, int64_t(std::ceil((end - start) / step)));
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = start + double(i) * step;
  return from_vector(v, {n}, opts);
}
Tensor arange(int64_t end, TensorOptions opts) { return arange(0.0, double(end), 1.0, opts); }

template <typename Gen>
static Tensor random_tensor(const Shape& shape, TensorOptions opts, Gen&& g) {
  check_shape(shape, "random tensor");
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  for (auto& x : v) x = g();
  return from_vector(v, shape, opts);
}

// Draws k * 2^-bits with `bits` the significand width of the dtype: every such value is exact
// in that dtype, so rounding can never turn a draw into 1.0 (a 53-bit draw rounded to bf16
// would be 1.0 once in 512 samples). For f64 this is Generator::uniform.
static int uniform_bits(DType t) {
  switch (t) {
    case DType::f32: return 24;
    case DType::f16: return 11;
    case DType::bf16: return 8;
    default: return 53;
  }
}

Tensor rand(const Shape& shape, TensorOptions opts, Generator* gen) {
  Generator& g = gen ? *gen : default_generator();
  const int bits = uniform_bits(opts.dtype);
  const double scale = std::ldexp(1.0, -bits);
  return random_tensor(shape, opts, [&] { return double(g.next_u64() >> (64 - bits)) * scale; });
}
Tensor randn(const Shape& shape, TensorOptions opts, Generator* gen) {
  Generator& g = gen ? *gen : default_generator();
  return random_tensor(shape, opts, [&] { return g.normal(); });
}
Tensor uniform(const Shape& shape, double lo, double hi, TensorOptions opts, Generator* gen) {
  KILN_CHECK(lo <= hi, "uniform: lo ", lo, " > hi ", hi);
  Generator& g = gen ? *gen : default_generator();
  return random_tensor(shape, opts, [&] { return lo + (hi - lo) * g.uniform(); });
}
Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions opts, Generator* gen) {
  KILN_CHECK(low < high, "randint: empty range [", low, ", ", high, ")");
  Generator& g = gen ? *gen : default_generator();
  return random_tensor(shape, opts,
                       [&] { return double(low + int64_t(g.below(uint64_t(high - low)))); });
}

Tensor tensor(std::initializer_list<double> values, TensorOptions opts) {
  return from_vector(std::vector<double>(values), {int64_t(values.size())}, opts);
}

}  // namespace kiln
