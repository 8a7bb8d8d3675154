#pragma once
// NVTX ranges and a per-op GPU time profiler. Safe to include from CPU-only builds: without
// CUDA everything here is a no-op.
//
//   cuda::NvtxRange r("forward");              // a named range in Nsight Systems
//   KILN_PROFILE_OP("conv2d", x.shape_str());  // in an op: times the rest of the scope on the
//                                             // current stream when the profiler is enabled;
//                                             // the shape expression is evaluated only then
//   cuda::enable_profiler(true); ...; std::cout << cuda::profiler_report();
//
// Op timing records CUDA events around the op on the current stream and reads them when the
// report is made (which synchronises); nothing is recorded while a stream is being captured.
// The table is shared by all threads (mutex).
#include <string>

namespace kiln {
class Tensor;
}

namespace kiln::cuda {

#ifdef KILN_WITH_CUDA

class NvtxRange {
 public:
  explicit NvtxRange(const char* name);
  explicit NvtxRange(const std::string& name) : NvtxRange(name.c_str()) {}
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

void enable_profiler(bool on);
bool profiler_enabled();
// Clears the table (pending events included).
void profiler_reset();
// A table like torch.profiler's key_averages(): op, calls, total ms, mean ms, % of total; rows
// sorted by total time. by_input: one row per op and main input (its Tensor::desc(), as
// torch.profiler's group_by_input_shape), so that, say, each convolution shape has its own row.
// Synchronises on the pending events.
std::string profiler_report(bool by_input = false);

// Times its own lifetime on the current stream; `name` null means disabled (no work at all).
// `name` must outlive the report (a string literal).
class ProfileOp {
 public:
  ProfileOp(const char* name, std::string shape);
  ~ProfileOp();
  ProfileOp(const ProfileOp&) = delete;
  ProfileOp& operator=(const ProfileOp&) = delete;

 private:
  const char* name_ = nullptr;
  std::string shape_;
  void* start_ = nullptr;  // cudaEvent_t, kept opaque so this header needs no CUDA headers
  void* stream_ = nullptr;
};

// The last op that entered KILN_PROFILE_OP on this thread (null when none or after a reset):
// the graph executor names it when a capture fails. Set whether or not the profiler is enabled.
const char* last_profiled_op();
void set_last_profiled_op(const char* name);
// The ops running on this thread now (an op calls ops), pushed and popped by the backend's
// profile_begin / profile_end with the op's main input (alive while the op runs: it is the op's
// argument); current_op() is the innermost one, or null outside any op. The caching allocator
// names it, with current_op_input()'s shape, when the device runs out of memory.
void push_current_op(const char* name, const Tensor* input = nullptr);
void pop_current_op();
const char* current_op();
// "f16[256, 64, 56, 56] cuda:0 NHWC" for the innermost op's input; "" when none.
std::string current_op_input();

#define KILN_PROFILE_CAT2(a, b) a##b
#define KILN_PROFILE_CAT(a, b) KILN_PROFILE_CAT2(a, b)
#define KILN_PROFILE_OP(name, shape)                                                   \
  ::kiln::cuda::ProfileOp KILN_PROFILE_CAT(kiln_profile_op_, __LINE__)(                \
      (::kiln::cuda::set_last_profiled_op(name),                                       \
       ::kiln::cuda::profiler_enabled() ? (name) : nullptr),                           \
      ::kiln::cuda::profiler_enabled() ? std::string(shape) : std::string())

#else  // CPU-only build

class NvtxRange {
 public:
  explicit NvtxRange(const char*) {}
  explicit NvtxRange(const std::string&) {}
};
inline void enable_profiler(bool) {}
inline bool profiler_enabled() { return false; }
inline void profiler_reset() {}
inline std::string profiler_report(bool = false) { return "kiln profiler: built without CUDA\n"; }
#define KILN_PROFILE_OP(name, shape) ((void)0)

#endif

}  // namespace kiln::cuda
