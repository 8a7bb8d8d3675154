#pragma once
// Pieces of kiln-train's job (tools/train/trainer.h): device choice, model construction, evaluation
// and log formatting.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/zoo.h"
#include "optim/model_file.h"
#include "tools/train/dist_env.h"
#include "tools/train/train_data.h"
#include "tools/train/trainer.h"

namespace kiln::train {

// --device (auto: cuda:0 when present, else cpu). A data-parallel rank (env.distributed())
// always gets GPU env.local_rank, made the current device.
Device pick_device(const std::string& device, const DistEnv& env);

// What the trained model is and expects (optim/model_file.h), from --arch and the data: IDX
// data (28x28, 1 channel) gets the small 3x3 stem without max pool; ImageFolder and synthetic
// data 3 channels and torchvision's stem (resnet_small keeps its small stem). Unknown archs throw,
// listing the valid ones.
ModelInfo model_info(const Config& c, const TrainData& data);

// The network of model_info(c, data), initial weights from c.seed.
std::shared_ptr<nn::Module> build_model(const Config& c, const TrainData& data);

// What --pretrained does with a classifier (fc.weight, fc.bias) of another class count.
enum class Classifier {
  ResetWhenDifferent,  // training: left at its fresh initialisation (fine-tuning)
  MustMatch            // --evaluate: an error, since a random classifier would be evaluated
};

// --pretrained PATH: loads every tensor strictly, the classifier as `classifier` says. Returns
// the one line that says what happened. Throws cli::UsageError naming the file: a mismatch (the
// key), a NaN or infinity (the tensor), a classifier of another size under MustMatch.
// `info` is the model's (model_info): its arch names the classifier (fc or heads.head).
std::string load_pretrained(const std::string& path, nn::Module& model, const ModelInfo& info,
                            Classifier classifier = Classifier::ResetWhenDifferent);

// --freeze-backbone: every parameter but the classifier's (fc., or a ViT's heads.head.) stops
// requiring grad. Returns the parameters still trained.
std::vector<Tensor> freeze_backbone(nn::Module& model, const std::string& arch);

// {Σ loss, top-1 hits, top-5 hits, samples, unreadable files skipped} over this rank's share of
// the test set, the model
// in eval mode (train mode again on return). A sample is a top-k hit when fewer than k logits
// exceed its label's (ties count as hits). When any logit is non-finite (a diverged model) the
// loss and both hit counts are NaN: no accuracy is claimed. A label outside the logits throws.
// `progress`, when set, is called after each batch with the batches done so far.
std::vector<double> evaluate(nn::Module& model, const TrainData& data,
                             const std::function<void(int64_t batches_done)>& progress = {});

// "m:ss", or "h:mm:ss" from one hour on; "?" for negative or non-finite values.
std::string fmt_time(double seconds);
std::string fmt_metric(double v, double factor, int decimals);  // v·factor, or "nan"/"inf"

// The name of the first parameter or buffer of `model` holding a NaN or inf, or "" when all
// values are finite (one device-to-host copy per floating tensor, then a scan of its bits).
std::string first_non_finite(const nn::Module& model);

}  // namespace kiln::train
