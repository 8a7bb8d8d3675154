// kiln-predict: the top-5 classes a trained model (kiln-train's model.safetensors) sees in JPEG
// or PNG images, on the GPU or the CPU. Contract and preprocessing: tools/predict/predict.h.
#include <string>
#include <vector>

#include "tools/predict/predict.h"

int main(int argc, char** argv) {
  return kiln::predict::main(std::vector<std::string>(argv + 1, argv + argc));
}
