// kiln-train: trains an image classifier. With no arguments it trains a small ResNet on
// Fashion-MNIST (Debian's dataset-fashion-mnist) on the GPU if there is one, else on the CPU,
// prints progress and the test accuracy after each epoch, and saves the final model.
// ImageFolder data (ImageNet layout), checkpoints, resume and multi-GPU: tools/train/trainer.h and
// --help. The job itself lives in the library (kiln::train) so tests can run it in-process.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "data/gpu_jpeg.h"
#include "tools/train/trainer.h"

int main(int argc, char** argv) {
  const int rc = kiln::train::main(std::vector<std::string>(argv + 1, argv + argc));
  // A thread stuck inside nvJPEG (--decoder nvjpeg's stall guard fired; the error is printed):
  // leave without exit's teardown of the CUDA context under it.
  if (kiln::data::gpu_jpeg_wedged()) {
    std::fflush(nullptr);
    std::_Exit(rc);
  }
  return rc;
}
