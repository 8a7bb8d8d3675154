// main() of the GPU suites: exit 77 (CTest's "skipped") when no CUDA device is visible, else
// run doctest with the command line.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "cuda/runtime.h"

int main(int argc, char** argv) {
  if (kiln::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
