#pragma once
// Dynamic-tape autograd.
//
// Every differentiable op that sees an input requiring grad (while grad mode is on) creates a
// Node: it holds the tensors its backward needs (SavedTensor), one Edge per input (to the
// input's own grad_fn, or to the AccumulateGrad node of a leaf; an empty edge for an input
// that needs no gradient) and the metadata of each input so the engine can check the shapes
// of the gradients it returns.
//
// Contract of Node::apply: it receives one gradient per forward output (an undefined Tensor
// means "zero") and RETURNS fresh gradients, one per input edge (undefined where the edge is
// empty). It never writes into an existing buffer: the engine sums gradients that reach the
// same input (`+=`) and AccumulateGrad adds into a leaf's .grad (`+=`, or `=` on first use).
//
// Exception, opt-in (accumulate-into): a node whose can_accumulate_into(i) is true may be handed,
// before apply(), a tensor accumulate_target(i) that the engine would otherwise add gradient i
// to: the partial sum already buffered for that input (when the engine holds the only reference
// to it and its memory), or the leaf's .grad (the AccumulateGrad behind the edge would `+=` into
// it anyway). A node that uses the target computes `target += grad_i` in place and returns the
// target itself as gradient i; otherwise it returns a fresh gradient as usual and the engine
// adds. This saves the separate `+=` pass (cuDNN's beta = 1 for convolution backward). When
// the caller of backward says a leaf's .grad lies in memory it has just zeroed (`zeroed` below),
// a leaf's .grad comes flagged accumulate_target_zero(i): the node then passes
// GradientMode::AddToZeros, and the backend may write instead of adding — the same values
// without reading the target (and, for cuDNN's weight gradients, without the fresh tensor and
// separate add its tuner may pick for `+=`).
//
// Backward frees saved tensors unless retain_graph is set; a second backward through such a
// node is an error. A SavedTensor remembers its storage's version and refuses to unpack if an
// in-place op changed it in between.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace kiln {

// Thread-local switch for recording. NoGradGuard turns it off for a scope.
struct GradMode {
  static bool is_enabled();
  static void set_enabled(bool on);
};

class NoGradGuard {
 public:
  NoGradGuard() : prev_(GradMode::is_enabled()) { GradMode::set_enabled(false); }
  ~NoGradGuard() { GradMode::set_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

struct Edge {
  std::shared_ptr<Node> fn;
  uint32_t input_nr = 0;
  bool valid() const { return fn != nullptr; }
};

struct InputMeta {
  Shape shape;
  DType dtype = DType::f32;
  Device device;
};

class Node {
 public:
  Node();
  // Unlinks the graph below iteratively: a chain of ~10^6 nodes would otherwise be freed by
  // one recursive destructor call per node and overflow the stack.
  virtual ~Node();
  virtual std::string name() const = 0;
  virtual std::vector<Tensor> apply(std::vector<Tensor>& grad_outputs) = 0;
  // Drops saved tensors after a backward without retain_graph.
  virtual void release_saved() {}
  // Whether apply() honours accumulate_target(input_nr) (see the contract above).
  virtual bool can_accumulate_into(size_t /*input_nr*/) const { return false; }
  // The tensor gradient `input_nr` may be accumulated into during apply(), or undefined. Dense,
  // with the input's shape, dtype and device. Set and cleared by the engine around apply().
  Tensor accumulate_target(size_t input_nr) const {
    return input_nr < accumulate_targets_.size() ? accumulate_targets_[input_nr] : Tensor();
  }
  // Whether accumulate_target(input_nr) is known to hold zeros: writing it is then the same as
  // adding to it.
  bool accumulate_target_zero(size_t input_nr) const {
    return input_nr < accumulate_zero_.size() && accumulate_zero_[input_nr];
  }
  // Engine only.
  void set_accumulate_target(size_t input_nr, const Tensor& t, bool zero = false);
  void clear_accumulate_targets() {
    accumulate_targets_.clear();
    accumulate_zero_.clear();
  }

  size_t num_inputs() const { return next_edges_.size(); }
  uint32_t num_outputs() const { return num_outputs_; }
  void set_num_outputs(uint32_t n) { num_outputs_ = n; }
  bool needs_input_grad(size_t i) const { return i < next_edges_.size() && next_edges_[i].valid(); }
  const std::vector<Edge>& next_edges() const { return next_edges_; }
  const std::vector<InputMeta>& input_meta() const { return input_meta_; }
  uint64_t sequence_nr() const { return sequence_nr_; }

  // Sets the edges and the input metadata from the forward inputs (undefined tensors allowed).
  void set_inputs(const std::vector<Tensor>& inputs);

 protected:
  std::vector<Edge> next_edges_;
  std::vector<InputMeta> input_meta_;
  uint32_t num_outputs_ = 1;
  uint64_t sequence_nr_;

 private:
  std::vector<Tensor> accumulate_targets_;
  std::vector<bool> accumulate_zero_;
};

// A tensor kept for backward. Stores an autograd-free alias (no reference cycle through the
// node's own outputs) and the storage version at save time.
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& t);
  // Throws if released (second backward) or modified in place since it was saved.
  Tensor get(const Node& owner) const;
  void release() {
    tensor_ = Tensor();
    released_ = true;
  }
  bool defined() const { return tensor_.defined(); }

 private:
  Tensor tensor_;
  uint64_t version_ = 0;
  bool released_ = false;
};

// The sink of a leaf: adds incoming gradients into the leaf's .grad, then runs the leaf's
// post-accumulate hooks. When the engine sets accumulate_target(0) and the incoming gradient is
// that very tensor (the leaf's .grad, into which the producers already accumulated in place),
// it only runs the hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> variable);
  std::string name() const override { return "AccumulateGrad"; }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override;
  // The leaf's .grad when a producer may accumulate into it in place with the same effect as
  // this node's `+=`: defined, dense, the leaf's shape, dtype and device. Else undefined (the
  // first gradient of a leaf is a copy, `=`, made here).
  Tensor grad_for_accumulation() const;

 private:
  std::shared_ptr<TensorImpl> variable_;
};

namespace autograd {

// True when grad mode is on and any defined input requires grad.
bool any_requires_grad(const std::vector<Tensor>& inputs);
// The edge that a gradient for `t` should flow along (empty when t needs no grad).
Edge edge_for(const Tensor& t);
// Makes `out` (output number `output_nr`) a result of `node`: sets grad_fn and requires_grad.
void set_history(const Tensor& out, const std::shared_ptr<Node>& node, uint32_t output_nr = 0);
// Refuses in-place modification of a tensor that autograd tracks (`op` names the op).
void check_inplace(const Tensor& t, const char* op);
// Whether a gradient a node was handed may be written in place with no one else seeing it: the
// handle is the only one to its tensor, the tensor the only one to its memory (no view), and it
// carries no graph of its own (create_graph). The engine's test before it offers a buffered
// partial sum as an accumulate target, and a node's own before it writes an incoming gradient.
bool sole_handle(const Tensor& t);

// Registers `fn` to run right after a gradient is accumulated into leaf `leaf`'s .grad (PyTorch's
// register_post_accumulate_grad_hook): once per AccumulateGrad call, on the backward's thread,
// with grad mode off; fn receives the leaf (its .grad is complete for this backward unless the
// leaf is reached again). Returns an id for remove_post_accumulate_grad_hook. Hooks run in
// registration order. Throws if `leaf` is not a leaf that requires grad.
uint64_t add_post_accumulate_grad_hook(const Tensor& leaf, std::function<void(const Tensor&)> fn);
// Removes a hook; unknown ids are ignored.
void remove_post_accumulate_grad_hook(const Tensor& leaf, uint64_t id);

// Accumulate-into (see Node): on unless KILN_ACCUMULATE_GRADS=0 or switched off here.
bool accumulate_into_enabled();
void set_accumulate_into_enabled(bool on);
// Counters since the last reset (all threads): targets handed to nodes, and targets the nodes
// used (gradient accumulated in place instead of by a separate add).
struct AccumulateStats {
  uint64_t offered = 0, used = 0;
  uint64_t offered_leaf = 0;  // of `offered`: a leaf's .grad
  uint64_t offered_zero = 0;  // of `offered_leaf`: flagged zero (backward's `zeroed`)
};
AccumulateStats accumulate_stats();
void reset_accumulate_stats();

// Runs backward from `roots` with the given gradients (undefined = ones for one-element roots).
// zeroed (optional): memory the caller has just zeroed and not written since — the fused
// optimizer's gradient arena right after its zero_grad (optim::ClassifierStep). A leaf's .grad
// that views it holds zeros, so a node handed it as its accumulate-into target may overwrite it
// (see Node). Wrong when such a .grad holds anything else: that value is lost.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
              bool retain_graph = false, const Tensor& zeroed = Tensor());

// Records a node for a one-input, one-output op whose backward is `fn(grad_out) -> grad_in`.
// Handy for views and simple elementwise ops; `fn` captures whatever it needs by value.
template <typename Fn>
class LambdaNode final : public Node {
 public:
  LambdaNode(std::string name, Fn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::string name() const override { return name_; }
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    if (!g[0].defined()) return {Tensor()};  // a zero gradient stays zero (undefined)
    return {fn_(g[0])};
  }

 private:
  std::string name_;
  Fn fn_;
};

template <typename Fn>
void record_unary(const char* name, const Tensor& input, const Tensor& out, Fn fn) {
  if (!any_requires_grad({input})) return;
  auto node = std::make_shared<LambdaNode<Fn>>(name, std::move(fn));
  node->set_inputs({input});
  set_history(out, node);
}

}  // namespace autograd
}  // namespace kiln
