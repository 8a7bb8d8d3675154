#pragma once
// kiln's umbrella header: #include <kiln/kiln.h> gives the tensor and autograd (kiln::Tensor),
// the functional ops (kiln::F), modules (kiln::nn), optimizers and mixed precision
// (kiln::optim, kiln::amp), data loading (kiln::data) and networks (kiln::models). Installed as
// <prefix>/include/kiln/kiln.h; in kiln's build tree CMake copies it to the same relative place.
// CUDA specifics (cuda/runtime.h, cuda/graph.h) pull in cuDNN's and cuBLASLt's headers and are
// left to include explicitly; kiln::cuda_available() here needs neither.
#include "core/autograd.h"
#include "core/device_query.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/generator.h"
#include "core/serialization.h"
#include "core/tensor.h"
#include "core/version.h"
#include "data/dataset.h"
#include "data/distributed_sampler.h"
#include "data/fashion_mnist.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "data/image_loader.h"
#include "data/loader.h"
#include "data/transforms.h"
#include "models/module.h"
#include "models/nn.h"
#include "models/resnet.h"
#include "models/transformer.h"
#include "models/vit.h"
#include "models/zoo.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "optim/amp.h"
#include "optim/checkpoint.h"
#include "optim/fused.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "optim/sgd.h"
#include "optim/train_step.h"
#include "optim/weight_average.h"
