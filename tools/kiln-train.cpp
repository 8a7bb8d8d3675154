// kiln-train: trains an image classifier. With no arguments it trains a small ResNet on
// Fashion-MNIST (Debian's dataset-fashion-mnist) on the GPU if there is one, else on the CPU,
// prints progress and the test accuracy after each epoch, and saves the final model.
// ImageFolder data (ImageNet layout), checkpoints, resume and multi-GPU: tools/train/trainer.h and
// --help. The job itself lives in the library (kiln::train) so tests can run it in-process.
#include <string>
#include <vector>

#include "tools/train/trainer.h"

int main(int argc, char** argv) {
  return kiln::train::main(std::vector<std::string>(argv + 1, argv + argc));
}
