#pragma once
// MNIST-style datasets (MNIST, Fashion-MNIST, KMNIST ...): a folder holding the four IDX files
//   train-images-idx3-ubyte  train-labels-idx1-ubyte  t10k-images-idx3-ubyte t10k-labels-idx1-ubyte
// each optionally gzipped (".gz"); the "train-images.idx3-ubyte" spelling is accepted too.
// Fashion-MNIST defaults to Debian's package dataset-fashion-mnist.
#include <array>
#include <string>

#include "data/idx.h"

namespace kiln::data {

enum class Split { Train, Test };

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

inline constexpr std::array<const char*, 10> kFashionMnistClasses = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

// Loads one split from `dir`: images u8 (N, H, W), labels u8 (N). A missing file is an error
// listing the names tried; `install_hint`, when non-empty, is appended to it.
IdxPair load_mnist(const std::string& dir, Split split, const std::string& install_hint = "");

// Fashion-MNIST: 60000 train / 10000 test images of 28x28, labels 0..9 (kFashionMnistClasses).
// When the files are missing the error says how to install them.
IdxPair load_fashion_mnist(const std::string& dir, Split split);
inline IdxPair load_fashion_mnist(Split split) {
  return load_fashion_mnist(kFashionMnistDir, split);
}

}  // namespace kiln::data
