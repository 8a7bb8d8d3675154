#pragma once
// Checkpoints in safetensors files (core/serialization.h), readable by PyTorch.
//
// Weights files hold exactly the keys of torchvision's state_dict: every parameter and buffer
// (BatchNorm's num_batches_tracked as a 0-d i64) under its dotted name, in PyTorch's order
// (each module's parameters, then its buffers, then its children). A file written by
// `safetensors.torch.save_file(model.state_dict(), path)` loads with load_weights, and a file
// written by save_weights loads with `model.load_state_dict(load_file(path), strict=True)`.
//
// Training checkpoints add the optimizer, a loss scaler, RNG streams and the epoch/step, so a run
// resumes bit-exactly (same weights and optimizer state as an uninterrupted run):
//   tensors   "model.<name>"   module parameters and buffers
//             "optim.<key>"    Optimizer::state_dict() ("state.<i>.<key>", "group.<g>.lr")
//             "scaler.<key>"   loss-scaler state as named tensors
//   metadata  "kiln.format" = "kiln-checkpoint-1", "kiln.epoch", "kiln.step",
//             "kiln.rng.default" (kiln::default_generator()), "kiln.rng.<name>" (named generators),
//             plus the caller's free-form entries ("arch", "args", ...) under their own names.
//
// Every save is atomic (temporary file in the same folder, fsync, rename): a crash mid-save
// leaves the previous file intact. Loads validate the whole file before changing anything, so a
// load that throws leaves the module, optimizer and generators as they were.
#include <map>
#include <string>
#include <vector>

#include "core/generator.h"
#include "models/module.h"
#include "core/serialization.h"

namespace kiln::optim {
class Optimizer;
}

namespace kiln {

// ---- model weights ----

// Which dtype floating tensors are written in. Float32 (the default) is what other frameworks
// expect; AsStored keeps f16/bf16/f64 weights as they are. Integer buffers are always kept.
enum class WeightsDType { Float32, AsStored };

// `module`'s parameters and buffers as save_weights writes them (floating ones in `dtype`),
// detached; for a writer that lays the file out later (safetensors_host).
NamedTensors weights_state(const nn::Module& module, WeightsDType dtype = WeightsDType::Float32);

// Writes `module`'s parameters and buffers (any device, dtype and memory format) to `path`.
void save_weights(const std::string& path, const nn::Module& module,
                  WeightsDType dtype = WeightsDType::Float32,
                  const std::map<std::string, std::string>& metadata = {});

enum class KeyMatch {
  Strict,  // every module key must be in the file and every file key in the module
  Lenient  // load the keys both have; report the others
};

// Keys that did not match (PyTorch's _IncompatibleKeys). Empty after a strict load.
struct LoadReport {
  std::vector<std::string> missing_keys;     // in the module, not in the file
  std::vector<std::string> unexpected_keys;  // in the file, not in the module
};

// Copies the file's tensors into the module's existing parameters and buffers: each keeps its
// device, dtype and memory format (values are converted, e.g. f32 file -> f16 weights). Errors
// (kiln::Error naming the file and the key): shape mismatch (both shapes), a floating tensor for a
// non-floating one or the reverse, and with KeyMatch::Strict any missing or unexpected key (the
// first 10 of each are listed, with the total count).
LoadReport load_weights(const std::string& path, nn::Module& module,
                        KeyMatch match = KeyMatch::Strict);

// The same from tensors already in memory; `source` names them in messages (a file path) and
// `prefix` is stripped from their names ("model."): names without it are ignored.
LoadReport load_state(const NamedTensors& tensors, nn::Module& module, KeyMatch match,
                      const std::string& source, const std::string& prefix = "");

// The module's parameters and buffers in PyTorch's state_dict order (live tensors, no copy).
NamedTensors state_dict(const nn::Module& module);

// ---- training checkpoints ----

// The objects a training checkpoint saves from and restores into. Pointers are not owned.
struct TrainingState {
  nn::Module* model = nullptr;            // required
  optim::Optimizer* optimizer = nullptr;  // optional
  // Loss-scaler state (scale, growth counter, ...). Saved as given; load_checkpoint replaces
  // the map with the file's tensors (on the CPU) for the caller to hand back to its scaler.
  std::map<std::string, Tensor> scaler;
  // Generators saved and restored besides kiln::default_generator() (which always is), e.g.
  // {"data", &loader_gen}. Names: non-empty, not "default".
  std::map<std::string, Generator*> generators;
  int64_t epoch = 0;
  int64_t step = 0;
  // Free-form strings ("arch", "args", ...); keys must not start with "kiln.".
  std::map<std::string, std::string> metadata;
};

void save_checkpoint(const std::string& path, const TrainingState& state);
// What save_checkpoint writes to `path`, as bytes (device state is copied to the host now):
// write them with write_file_atomic (core/serialization.h), on another thread if you like.
std::string checkpoint_bytes(const std::string& path, const TrainingState& state);
// The same in two steps (core/serialization.h's SafetensorsHost): the state is copied to the
// host now; join() gives checkpoint_bytes' bytes later, on any thread (kiln-train's background
// writer does, so the training thread pays only for the copies).
SafetensorsHost checkpoint_host(const std::string& path, const TrainingState& state);

// Restores `state.model` (strict), `state.optimizer` (when set), kiln::default_generator() and
// every generator in `state.generators` (each must be in the file), and sets scaler, epoch, step
// and metadata from the file. Errors name the file and the key (a negative epoch or step is one).
void load_checkpoint(const std::string& path, TrainingState& state);

}  // namespace kiln
