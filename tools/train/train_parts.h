#pragma once
// Pieces of kiln-train's job (tools/train/trainer.h): device choice, model construction, evaluation
// and log formatting.
#include <memory>
#include <string>
#include <vector>

#include "tools/train/dist_env.h"
#include "models/resnet.h"
#include "tools/train/train_data.h"
#include "tools/train/trainer.h"

namespace kiln::train {

// --device (auto: cuda:0 when present, else cpu). A data-parallel rank (env.distributed())
// always gets GPU env.local_rank, made the current device.
Device pick_device(const std::string& device, const DistEnv& env);

// --arch for the data: IDX data (28x28, 1 channel) gets the small 3x3 stem without max pool;
// ImageFolder data 3 channels and torchvision's stem (resnet_small keeps its small stem).
// Initial weights from c.seed. Unknown names throw, listing the valid ones.
std::shared_ptr<models::ResNet> build_model(const Config& c, const TrainData& data);

// {Σ loss, top-1 hits, top-5 hits, samples} over this rank's share of the test set, the model
// in eval mode (train mode again on return). A sample is a top-k hit when fewer than k logits
// exceed its label's (ties count as hits). When any logit is non-finite (a diverged model) the
// loss and both hit counts are NaN: no accuracy is claimed. A label outside the logits throws.
std::vector<double> evaluate(nn::Module& model, const TrainData& data);

std::string fmt_time(double seconds);  // "m:ss"; "?" for negative or non-finite values
std::string json_number(double v);     // %.6g; non-finite values as null
std::string fmt_metric(double v, double factor, int decimals);  // v·factor, or "nan"/"inf"

// The name of the first parameter or buffer of `model` holding a NaN or inf, or "" when all
// values are finite (one device-to-host copy per floating tensor).
std::string first_non_finite(const nn::Module& model);
}  // namespace kiln::train
