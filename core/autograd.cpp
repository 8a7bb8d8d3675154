#include "core/autograd.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_set>
#include <queue>
#include <unordered_map>

#include "core/backend.h"
#include "core/switches.h"

namespace kiln {

namespace {
thread_local bool g_grad_enabled = true;
std::atomic<uint64_t> g_sequence{0};
}  // namespace

bool GradMode::is_enabled() { return g_grad_enabled; }
void GradMode::set_enabled(bool on) { g_grad_enabled = on; }

Node::Node() : sequence_nr_(g_sequence.fetch_add(1)) {}

Node::~Node() {
  // Nodes whose last owner is this one are parked and released by the outermost ~Node's loop,
  // so the depth of destructor calls stays at two whatever the depth of the graph.
  thread_local std::vector<std::shared_ptr<Node>> pending;
  thread_local bool draining = false;
  for (Edge& e : next_edges_)
    if (e.fn && e.fn.use_count() == 1) pending.push_back(std::move(e.fn));
  if (draining) return;
  draining = true;
  while (!pending.empty()) {
    std::shared_ptr<Node> n = std::move(pending.back());
    pending.pop_back();
    n.reset();  // may park more nodes
  }
  draining = false;
}

void Node::set_accumulate_target(size_t input_nr, const Tensor& t, bool zero) {
  if (accumulate_targets_.size() <= input_nr) accumulate_targets_.resize(input_nr + 1);
  if (accumulate_zero_.size() <= input_nr) accumulate_zero_.resize(input_nr + 1);
  accumulate_targets_[input_nr] = t;
  accumulate_zero_[input_nr] = zero;
}

void Node::set_inputs(const std::vector<Tensor>& inputs) {
  next_edges_.clear();
  input_meta_.clear();
  for (const Tensor& t : inputs) {
    next_edges_.push_back(autograd::edge_for(t));
    if (t.defined())
      input_meta_.push_back({t.shape(), t.dtype(), t.device()});
    else
      input_meta_.push_back({});
  }
}

// ---------------- SavedTensor ----------------

SavedTensor::SavedTensor(const Tensor& t) {
  if (t.defined()) {
    tensor_ = t.detach();
    version_ = t.version();
  }
}

Tensor SavedTensor::get(const Node& owner) const {
  KILN_CHECK(!released_, "trying to backward through the graph a second time (", owner.name(),
             "'s saved tensors were freed by the first backward); pass retain_graph=true to the "
             "first backward if you need to backward twice");
  if (tensor_.defined()) {
    KILN_CHECK(tensor_.version() == version_, "a tensor ", tensor_.desc(), " saved by ",
               owner.name(), " for backward was modified by an in-place operation (version ",
               version_, " when saved, now ", tensor_.version(), ")");
  }
  return tensor_;
}

// ---------------- AccumulateGrad ----------------

AccumulateGrad::AccumulateGrad(std::shared_ptr<TensorImpl> variable)
    : variable_(std::move(variable)) {
  input_meta_.push_back({variable_->shape, variable_->dtype, variable_->device});
}

Tensor AccumulateGrad::grad_for_accumulation() const {
  Tensor cur = Tensor(variable_).grad();
  if (!cur.defined() || cur.requires_grad()) return {};
  if (cur.shape() != variable_->shape || cur.dtype() != variable_->dtype ||
      cur.device() != variable_->device)
    return {};
  if (!cur.is_contiguous(cur.suggest_memory_format())) return {};  // dense: no overlap, no gaps
  return cur;
}

namespace {

// `.grad += g` through the device's backend table (core cannot call ops/'s add_, which adds
// broadcasting and autograd checks neither operand needs here).
void add_into_grad(const Tensor& grad, const Tensor& g) {
  KILN_CHECK(grad.shape() == g.shape() && grad.dtype() == g.dtype() && grad.device() == g.device(),
             "autograd: cannot add a gradient ", g.desc(), " into .grad ", grad.desc());
  // Reading .grad's memory through another layout while writing it would read stale values.
  const Tensor src = g.shares_storage(grad) && (g.strides() != grad.strides() ||
                                                g.offset() != grad.offset())
                         ? g.clone()
                         : g;
  grad.bump_version();
  backend(grad).binary(BinaryOp::AddScaled, grad, grad, src, 1.0);
}

}  // namespace

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>& grads) {
  Tensor var(variable_);
  Tensor g = grads[0];
  if (!g.defined()) return {};
  NoGradGuard no_grad;
  Tensor cur = var.grad();
  if (g.is_same(accumulate_target(0))) {
    // The producer already did `.grad += g` in place (the engine offered .grad, see backward).
  } else if (!cur.defined()) {
    // First gradient: `=`. Always a private copy, laid out like the variable, so later `+=`
    // never writes into a tensor someone else holds.
    var.set_grad(g.clone(var.suggest_memory_format()).detach());
  } else {
    add_into_grad(cur, g);  // `+=`
  }
  AutogradMeta& m = var.autograd_meta();
  if (!m.post_accumulate_hooks.empty()) {
    const auto hooks = m.post_accumulate_hooks;  // a hook may add or remove hooks
    for (const auto& [id, fn] : hooks) fn(var);
  }
  return {};
}

// ---------------- helpers ----------------

namespace autograd {

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

Edge edge_for(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  if (t.grad_fn()) return {t.grad_fn(), t.output_nr()};
  AutogradMeta& m = t.autograd_meta();
  std::shared_ptr<Node> acc = m.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    m.grad_accumulator = acc;
  }
  return {acc, 0};
}

uint64_t add_post_accumulate_grad_hook(const Tensor& leaf, std::function<void(const Tensor&)> fn) {
  KILN_CHECK(leaf.defined() && leaf.is_leaf() && leaf.requires_grad(),
             "add_post_accumulate_grad_hook: needs a leaf that requires grad");
  KILN_CHECK(fn, "add_post_accumulate_grad_hook: empty hook");
  static std::atomic<uint64_t> next_id{1};
  const uint64_t id = next_id++;
  leaf.autograd_meta().post_accumulate_hooks.emplace_back(id, std::move(fn));
  return id;
}

void remove_post_accumulate_grad_hook(const Tensor& leaf, uint64_t id) {
  if (!leaf.defined() || !leaf.impl().autograd) return;
  auto& hooks = leaf.impl().autograd->post_accumulate_hooks;
  std::erase_if(hooks, [id](const auto& h) { return h.first == id; });
}

void set_history(const Tensor& out, const std::shared_ptr<Node>& node, uint32_t output_nr) {
  AutogradMeta& m = out.autograd_meta();
  m.requires_grad = true;
  m.grad_fn = node;
  m.output_nr = output_nr;
}

void check_inplace(const Tensor& t, const char* op) {
  if (GradMode::is_enabled() && t.requires_grad()) {
    KILN_FAIL(op, ": in-place modification of ", t.desc(),
              ", which requires grad, is not supported while recording; wrap it in NoGradGuard "
              "(as optimizers do) or use the out-of-place op");
  }
}

bool sole_handle(const Tensor& t) {
  return t.defined() && t.impl_ptr().use_count() == 1 && t.storage().use_count() == 1 &&
         !t.requires_grad();
}

namespace {

constinit RuntimeSwitch g_accumulate{&Switches::accumulate_grads};  // KILN_ACCUMULATE_GRADS
std::atomic<uint64_t> g_offered{0}, g_offered_leaf{0}, g_offered_zero{0}, g_used{0};

// A buffered partial sum the engine may hand to a node to accumulate into: nobody else can
// observe the in-place update (the engine holds the only handle, and that handle the only
// reference to the memory), it is dense (an expanded tensor would take several `+=` into one
// element), and it is exactly the input's shape, dtype and device.
bool exclusive_partial_sum(const Tensor& t, const InputMeta& m) {
  return sole_handle(t) && t.shape() == m.shape && t.dtype() == m.dtype &&
         t.device() == m.device && t.is_contiguous(t.suggest_memory_format());
}

// Node names as stable C strings for the profiler's table (which keeps the pointers).
const char* interned_name(const Node& n) {
  static std::mutex mu;
  static std::unordered_set<std::string> names;
  std::lock_guard<std::mutex> lock(mu);
  return names.insert(n.name()).first->c_str();
}

// a + b for two gradients of one output (validate_grads checked shape, dtype and device),
// through the device's backend table; channels-last when both are, as F::add would choose.
Tensor add_grads(const Tensor& a, const Tensor& b) {
  const MemoryFormat fmt = a.suggest_memory_format() == MemoryFormat::ChannelsLast &&
                                   b.suggest_memory_format() == MemoryFormat::ChannelsLast
                               ? MemoryFormat::ChannelsLast
                               : MemoryFormat::Contiguous;
  Tensor out =
      empty(a.shape(), TensorOptions(a.dtype()).with_device(a.device()).with_memory_format(fmt));
  backend(a).binary(BinaryOp::AddScaled, out, a, b, 1.0);
  return out;
}

// Gradient shapes must match the forward input they belong to; catch an op's bug here rather
// than as a wrong answer three layers later.
void validate_grads(const Node& node, std::vector<Tensor>& grads) {
  KILN_CHECK(grads.size() == node.num_inputs() || grads.empty(), "autograd: ", node.name(),
             " returned ", grads.size(), " gradients for ", node.num_inputs(), " inputs");
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined() || !node.needs_input_grad(i)) continue;
    const InputMeta& m = node.input_meta()[i];
    KILN_CHECK(grads[i].shape() == m.shape, "autograd: ", node.name(), " returned a gradient of ",
               "shape ", grads[i].shape_str(), " for input ", i, " of shape ", shape_str(m.shape));
    if (grads[i].dtype() != m.dtype) grads[i] = grads[i].to(m.dtype);
    KILN_CHECK(grads[i].device() == m.device, "autograd: ", node.name(), " returned a gradient on ",
               grads[i].device(), " for input ", i, " on ", m.device);
  }
}

}  // namespace

bool accumulate_into_enabled() { return g_accumulate.get(); }
void set_accumulate_into_enabled(bool on) { g_accumulate.set(on); }

AccumulateStats accumulate_stats() {
  return {g_offered.load(), g_used.load(), g_offered_leaf.load(), g_offered_zero.load()};
}
void reset_accumulate_stats() {
  g_offered = 0;
  g_used = 0;
  g_offered_leaf = 0;
  g_offered_zero = 0;
}

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
              bool retain_graph, const Tensor& zeroed) {
  KILN_CHECK(roots.size() == grads.size(), "backward: ", roots.size(), " roots but ",
             grads.size(), " gradients");
  NoGradGuard no_grad;  // backward itself is not recorded (no double backward)

  struct Buffer {
    std::vector<Tensor> grads;
    // AccumulateGrad only: grads[0] is the leaf's .grad, into which the producer accumulated.
    bool in_grad = false;
  };
  std::unordered_map<Node*, Buffer> buffers;
  std::unordered_map<Node*, int> deps;
  std::unordered_map<Node*, std::shared_ptr<Node>> keep;  // owners while the engine runs

  auto slot_of = [&](const Edge& e) -> Tensor& {
    Buffer& b = buffers[e.fn.get()];
    if (b.grads.empty()) b.grads.resize(e.fn->num_outputs());
    return b.grads[e.input_nr];
  };
  auto add_grad = [&](const Edge& e, const Tensor& g) {
    Tensor& slot = slot_of(e);
    slot = slot.defined() ? add_grads(slot, g) : g;  // `+=` across edges into one output
  };

  // Accumulate-into (see core/autograd.h). Before node n runs, for each input i it opts in for:
  //  * the consumer's slot already holds a partial sum that only the engine can see: it moves
  //    into n as target i (so the slot is empty while n runs, and its handle is the only one);
  //  * the slot is empty, the consumer is an AccumulateGrad, this edge is its last pending
  //    contribution (deps == 1) and the leaf's .grad is defined: .grad is the target. With
  //    more contributions pending the first one is buffered as today, so the summation order —
  //    .grad + (g1 + g2 + ...) — and hence every bit of the result is unchanged. The .grad
  //    is untouched so far in this backward (AccumulateGrad adds once, after its last
  //    contribution), so when it views `zeroed` it still holds zeros: flagged so.
  // After apply, a used target is stored in the slot (nothing to add); an unused one goes back
  // into the slot and the fresh gradient is added to it as before, in the same order.
  struct Offer {
    size_t i;
    Tensor target;
    bool leaf;  // target is a leaf's .grad (else a moved-out partial sum)
  };
  std::vector<Offer> offers;
  const bool accumulate = accumulate_into_enabled();
  auto offer_targets = [&](Node* n) {
    offers.clear();
    const auto& edges = n->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.valid() || !n->can_accumulate_into(i)) continue;
      bool repeated = false;  // two inputs of n feed one slot: keep it simple, offer none
      for (size_t j = 0; j < edges.size(); ++j)
        repeated |= j != i && edges[j].fn == e.fn && edges[j].input_nr == e.input_nr;
      if (repeated) continue;
      auto it = buffers.find(e.fn.get());
      Tensor* slot = it != buffers.end() && !it->second.grads.empty()
                         ? &it->second.grads[e.input_nr] : nullptr;
      const InputMeta& m = n->input_meta()[i];
      Offer o{i, Tensor(), false};
      if (slot && slot->defined()) {
        if (!exclusive_partial_sum(*slot, m)) continue;
        o.target = std::move(*slot);
        *slot = Tensor();
      } else if (auto* acc = dynamic_cast<AccumulateGrad*>(e.fn.get());
                 acc && deps[acc] == 1) {
        o.target = acc->grad_for_accumulation();
        if (!o.target.defined()) continue;
        o.leaf = true;
      } else {
        continue;
      }
      const bool zero = o.leaf && zeroed.defined() && o.target.shares_storage(zeroed);
      n->set_accumulate_target(i, o.target, zero);
      offers.push_back(std::move(o));
      ++g_offered;
      if (offers.back().leaf) ++g_offered_leaf;
      if (zero) ++g_offered_zero;
    }
  };
  auto settle_targets = [&](Node* n, std::vector<Tensor>& out) {
    for (Offer& o : offers) {
      const Edge& e = n->next_edges()[o.i];
      Tensor& slot = slot_of(e);  // empty: moved out, or nothing buffered
      if (o.i < out.size() && out[o.i].is_same(o.target)) {
        ++g_used;
        slot = std::move(o.target);
        out[o.i] = Tensor();  // already summed
        if (o.leaf) buffers[e.fn.get()].in_grad = true;
      } else if (!o.leaf) {
        slot = std::move(o.target);  // add_grad adds the fresh gradient to it, as before
      }
    }
    offers.clear();
    n->clear_accumulate_targets();
  };

  std::vector<Node*> root_nodes;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    KILN_CHECK(r.defined(), "backward: root ", i, " is undefined");
    KILN_CHECK(r.requires_grad(), "backward: element ", i, " of tensors ", r.desc(),
               " does not require grad and has no grad_fn");
    Tensor g = grads[i];
    if (!g.defined()) {
      KILN_CHECK(r.numel() == 1, "backward: grad can be implicitly created only for one-element "
                 "outputs; got ", r.desc(), " — pass a gradient of the same shape");
      g = ones_like(r);
    } else {
      KILN_CHECK(g.shape() == r.shape() && g.device() == r.device(), "backward: gradient ",
                 g.desc(), " does not match root ", r.desc());
      if (g.dtype() != r.dtype()) g = g.to(r.dtype());  // as validate_grads does for nodes
    }
    Edge e = edge_for(r);
    keep[e.fn.get()] = e.fn;
    add_grad(e, g);
    root_nodes.push_back(e.fn.get());
  }

  // Count, for every reachable node, how many edges inside the graph point at it.
  std::vector<Node*> stack(root_nodes.begin(), root_nodes.end());
  std::unordered_map<Node*, bool> seen;
  for (Node* n : root_nodes) seen[n] = true;
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (!e.valid()) continue;
      ++deps[e.fn.get()];
      keep[e.fn.get()] = e.fn;
      if (!seen[e.fn.get()]) {
        seen[e.fn.get()] = true;
        stack.push_back(e.fn.get());
      }
    }
  }

  // Ready nodes run newest first (highest sequence number): deterministic order.
  auto later = [](Node* a, Node* b) { return a->sequence_nr() < b->sequence_nr(); };
  std::priority_queue<Node*, std::vector<Node*>, decltype(later)> ready(later);
  for (Node* n : root_nodes)
    if (deps[n] == 0 && seen[n]) {
      ready.push(n);
      seen[n] = false;  // pushed once
    }

  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    Buffer& buf = buffers[n];
    std::vector<Tensor> in = std::move(buf.grads);
    if (buf.in_grad) n->set_accumulate_target(0, in[0]);  // tells AccumulateGrad not to add
    buffers.erase(n);
    if (in.empty()) in.resize(n->num_outputs());
    if (accumulate) offer_targets(n);
    std::vector<Tensor> out;
    try {
      const bool on_device = !in.empty() && in[0].defined() && !in[0].is_cpu();
      OpProfileScope profile(on_device ? interned_name(*n) : nullptr,
                             on_device ? in[0] : Tensor());
      out = n->apply(in);
    } catch (...) {
      n->clear_accumulate_targets();  // no tensor of this backward outlives it in the node
      throw;
    }
    if (!retain_graph) n->release_saved();
    validate_grads(*n, out);
    if (!offers.empty()) settle_targets(n, out);
    n->clear_accumulate_targets();
    const auto& edges = n->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.valid()) continue;
      if (i < out.size() && out[i].defined()) add_grad(e, out[i]);
      if (--deps[e.fn.get()] == 0) ready.push(e.fn.get());
    }
  }
}

}  // namespace autograd
}  // namespace kiln
