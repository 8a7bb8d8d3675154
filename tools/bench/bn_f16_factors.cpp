// Batch norm's factors in f16, studied on the CPU (docs/lab/norm-conv.md, "f16 factors"): how far
// the output of the apply moves from the exact result, per form, on channels from a trained
// network's checkpoint and on a sweep that includes the ranges where f16 runs out.
//
// Forward, relu(bn(y)) with y stored in f16:
//   f32      h(relu(fmaf(y, s, t)))                 apply_kernel today (s, t in f32)
//   f16      relu(h(y·h(s) + h(t)))                 KILN_PROLOGUE_F16: one __hfma2_relu a pair
//   f16-c    relu(h(h(s)·h(y − h(μ)) + h(β)))       centred: __hsub2, then __hfma2_relu
//   f16-cc   relu(h(h(s)·h(y − h(μ)) + h(β′)))      centred, compensated: β′ = β − s·(μ − h(μ))
// Backward, dx = a·g + b·x + c (backward_finish_kernel's coefficients, c = −a·Σg/n − b·μ):
//   f32      h(fmaf(a, g, fmaf(b, x, c)))           backward_apply_kernel today
//   f16      h(h(a)·g + h(h(b)·x + h(c)))           two __hfma2 a pair
//   f16-c    h(h(a)·g + h(h(b)·h(x − h(μ)) + h(c′)))  c′ = −a·Σg/n; __hsub2 and two __hfma2
//   f16-cc   the same with c″ = c′ − b·(μ − h(μ))
// h() is one rounding to f16, to nearest even; each fused multiply-add is exact before its
// rounding (computed in __float128). The exact value is computed in double from the same f16
// inputs. Errors are in units of u·rms, u = 2⁻¹¹ (f16's unit roundoff) and rms the channel's
// exact output's root mean square: 1 is half an f16 step at the channel's typical value.
// "y's rounding" is the yardstick: what storing y in f16 (before any factor) already moves the
// exact output by, the same units.
//
// Build and run (links a CPU-only build's library for the checkpoint reader; x86-64, for
// __float128):
//   KILN_CUDA=OFF KILN_BUILD_DIR=build-cpu bash tools/kiln.sh build
//   g++ -O2 -std=c++20 -I. -Ibuild-cpu/include tools/bench/bn_f16_factors.cpp
//       build-cpu/libkiln.a -ljpeg -lz -fopenmp -pthread -o /tmp/bnf16   (one line)
//   /tmp/bnf16 [CHECKPOINT.safetensors]   (kiln-train's model.safetensors: its batch norms)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/serialization.h"

namespace {

using f16 = _Float16;
using q = __float128;

double h(double v) { return double(f16(v)); }  // one rounding (double → f16)
double fma16(double a, double b, double c) { return double(f16(q(a) * q(b) + q(c))); }
double relu(double v) { return v < 0 ? 0.0 : v; }  // NaN stays NaN
constexpr double kU = 1.0 / 2048;                  // f16's unit roundoff

struct Channel {
  double gamma, beta, mean, sd;  // y ~ N(mean, sd²) per channel
};

// Per form: values that differ from the best f16 (the exact value rounded once), the largest
// error, the largest per-channel mean error (a bias the same for every value of the channel),
// and channels with a non-finite output where the exact one rounds to a finite f16 (values
// whose exact result is beyond f16's range are left out of every count).
struct Tally {
  long values = 0, differ = 0;
  double max_err = 0, max_bias = 0;
  int nonfinite = 0;
  void add_channel(const std::vector<double>& out, const std::vector<double>& exact, double rms) {
    double bias = 0;
    long counted = 0;
    bool bad = false;
    for (size_t i = 0; i < out.size(); ++i) {
      if (!std::isfinite(h(exact[i]))) continue;  // out of f16's range in every form
      ++values;
      if (!std::isfinite(out[i])) {
        bad = true;
        continue;
      }
      if (out[i] != h(exact[i])) ++differ;
      const double e = (out[i] - exact[i]) / (kU * rms);
      max_err = std::max(max_err, std::fabs(e));
      bias += e;
      ++counted;
    }
    nonfinite += bad;
    if (counted > 0) max_bias = std::max(max_bias, std::fabs(bias / double(counted)));
  }
  void print(const char* name) const {
    std::printf("    %-13s differ %6.2f%%  max %9.3g  bias %9.3g  non-finite %d\n", name,
                100.0 * double(differ) / double(std::max(values, 1L)), max_err, max_bias,
                nonfinite);
  }
};

struct Study {
  Tally fwd_y, fwd32, fwd16, fwd16c, fwd16cc, bwd_x, bwd32, bwd16, bwd16c, bwd16cc;
  int channels = 0;
};

// One channel: `samples` values of y, forward and backward. The backward's incoming gradient
// is g = gs·(z + 0.3·x̂ + 0.1), z ~ N(0, 1): correlated with x̂, so both of the backward's sums
// are non-zero; gs is the loss-scaled gradient's size.
void run_channel(const Channel& ch, double gs, int samples, std::mt19937_64& rng, Study& st) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> y64(samples), y(samples), g(samples);
  for (int i = 0; i < samples; ++i) {
    y64[i] = ch.mean + ch.sd * nd(rng);
    y[i] = h(y64[i]);
  }
  // Batch statistics of the stored values, in double (the finalize kernel's arithmetic).
  double s1 = 0, s2 = 0;
  for (double v : y) s1 += v, s2 += v * v;
  const double n = samples, mu = s1 / n, var = std::max(s2 / n - mu * mu, 0.0);
  const double k = 1.0 / std::sqrt(var + 1e-5);
  const double scale = ch.gamma * k, shift = ch.beta - mu * scale;
  const float s32 = float(scale), t32 = float(shift);
  // Forward.
  const double mu16 = h(mu), beta_c = ch.beta - scale * (mu - mu16);
  std::vector<double> ex(samples), ey(samples), o32(samples), o16(samples), o16c(samples),
      o16cc(samples);
  double rms = 0;
  for (int i = 0; i < samples; ++i) {
    ex[i] = relu((y[i] - mu) * scale + ch.beta);
    ey[i] = relu((y64[i] - mu) * scale + ch.beta);
    rms += ex[i] * ex[i];
    o32[i] = h(relu(double(std::fma(float(y[i]), s32, t32))));
    o16[i] = relu(fma16(y[i], h(s32), h(t32)));
    o16c[i] = relu(fma16(h(s32), h(y[i] - mu16), h(ch.beta)));
    o16cc[i] = relu(fma16(h(s32), h(y[i] - mu16), h(beta_c)));
  }
  rms = std::sqrt(rms / n);
  if (rms > 0) {
    st.fwd_y.add_channel(ey, ex, rms);
    st.fwd32.add_channel(o32, ex, rms);
    st.fwd16.add_channel(o16, ex, rms);
    st.fwd16c.add_channel(o16c, ex, rms);
    st.fwd16cc.add_channel(o16cc, ex, rms);
  }
  // Backward (no ReLU mask: the coefficients' arithmetic is the question).
  double sg = 0, sgx = 0;
  for (int i = 0; i < samples; ++i) {
    const double xhat = (y[i] - mu) * k;
    g[i] = h(gs * (nd(rng) + 0.3 * xhat + 0.1));
    sg += g[i];
    sgx += g[i] * (y[i] - mu);
  }
  const double a = ch.gamma * k, sum_gxhat = sgx * k, b = -a * k * sum_gxhat / n;
  const double c = -a * sg / n - b * mu, cc = -a * sg / n, ccc = cc - b * (mu - mu16);
  const float a32 = float(a), b32 = float(b), c32 = float(c);
  std::vector<double> dx(samples), dxy(samples), d32(samples), d16(samples), d16c(samples),
      d16cc(samples);
  double drms = 0;
  for (int i = 0; i < samples; ++i) {
    dx[i] = a * g[i] + b * (y[i] - mu) + cc;
    dxy[i] = a * g[i] + b * (y64[i] - mu) + cc;
    drms += dx[i] * dx[i];
    d32[i] = h(double(std::fma(a32, float(g[i]), std::fma(b32, float(y[i]), c32))));
    d16[i] = fma16(h(a32), g[i], fma16(h(b32), y[i], h(c32)));
    d16c[i] = fma16(h(a32), g[i], fma16(h(b32), h(y[i] - mu16), h(float(cc))));
    d16cc[i] = fma16(h(a32), g[i], fma16(h(b32), h(y[i] - mu16), h(float(ccc))));
  }
  drms = std::sqrt(drms / n);
  if (drms > 0 && std::isfinite(drms)) {
    st.bwd_x.add_channel(dxy, dx, drms);
    st.bwd32.add_channel(d32, dx, drms);
    st.bwd16.add_channel(d16, dx, drms);
    st.bwd16c.add_channel(d16c, dx, drms);
    st.bwd16cc.add_channel(d16cc, dx, drms);
  }
  ++st.channels;
}

void report(const char* title, const Study& st) {
  std::printf("%s (%d channels)\n  forward relu(bn(y)):\n", title, st.channels);
  st.fwd_y.print("y's rounding");
  st.fwd32.print("f32");
  st.fwd16.print("f16");
  st.fwd16c.print("f16-c");
  st.fwd16cc.print("f16-cc");
  std::printf("  backward a·g + b·x + c:\n");
  st.bwd_x.print("x's rounding");
  st.bwd32.print("f32");
  st.bwd16.print("f16");
  st.bwd16c.print("f16-c");
  st.bwd16cc.print("f16-cc");
}

// The batch norms of a kiln-train checkpoint: every "<name>.running_mean" with its running_var,
// weight and bias, as channels of y ~ N(running_mean, running_var).
std::vector<Channel> checkpoint_channels(const std::string& path) {
  const kiln::SafetensorsData file = kiln::load_safetensors(path);
  std::vector<Channel> out;
  const std::string tail = ".running_mean";
  for (const auto& [name, t] : file.tensors) {
    if (name.size() <= tail.size() || name.compare(name.size() - tail.size(), tail.size(), tail))
      continue;
    const std::string base = name.substr(0, name.size() - tail.size());
    const float* m = t.data<float>();
    const float* v = file.at(base + ".running_var").data<float>();
    const float* w = file.at(base + ".weight").data<float>();
    const float* b = file.at(base + ".bias").data<float>();
    for (int64_t c = 0; c < t.numel(); ++c)
      out.push_back({w[c], b[c], m[c], std::sqrt(std::max(double(v[c]), 0.0))});
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937_64 rng(1);
  const int samples = 4096;
  const double grad_sizes[] = {1.0, 256.0, 4096.0};
  if (argc > 1) {
    const std::vector<Channel> chans = checkpoint_channels(argv[1]);
    double worst_ratio = 0;
    for (const Channel& ch : chans) worst_ratio = std::max(worst_ratio, std::fabs(ch.mean) / ch.sd);
    std::printf("%s: %zu batch-norm channels, largest |mean| / sd %.3g\n", argv[1], chans.size(),
                worst_ratio);
    for (double gs : grad_sizes) {
      Study st;
      for (const Channel& ch : chans) run_channel(ch, gs, samples, rng, st);
      char title[96];
      std::snprintf(title, sizeof title, "checkpoint, gradient size %g", gs);
      report(title, st);
    }
  }
  rng.seed(2);  // the sweep's and the edges' figures do not depend on the checkpoint
  // The sweep: |mean| / sd from 0 to 1,024, gamma 1, beta 0 and 0.5, sd 1 (sd 0.01 and 30 give
  // the same relative figures while the factors stay in range).
  for (double ratio : {0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0}) {
    for (double gs : {1.0, 4096.0}) {
      Study st;
      for (double beta : {0.0, 0.5})
        for (int rep = 0; rep < 8; ++rep)
          run_channel({1.0, beta, ratio, 1.0}, gs, samples, rng, st);
      char title[96];
      std::snprintf(title, sizeof title, "sweep |mean|/sd %g, gradient size %g", ratio, gs);
      report(title, st);
    }
  }
  // Where f16 runs out: a near-constant channel (sd 1e-4, so scale ≈ 316 and shift ≈ −316·mean;
  // gradient size 1 keeps a·g in f16's range), and small gammas (a zero-initialised residual
  // batch norm early in training; gradient size 256).
  struct Edge {
    const char* name;
    Channel ch;
    double gs;
  };
  const Edge edges[] = {{"near-constant, mean 300", {1.0, 0.25, 300.0, 1e-4}, 1.0},
                        {"near-constant, mean 3", {1.0, 0.25, 3.0, 1e-4}, 1.0},
                        {"gamma 1e-3, sd 2", {1e-3, 0.0, 0.0, 2.0}, 256.0},
                        {"gamma 1e-5, sd 2", {1e-5, 0.0, 0.0, 2.0}, 256.0},
                        {"gamma 1e-5, mean 4", {1e-5, 0.0, 4.0, 1.0}, 256.0}};
  for (const Edge& e : edges) {
    Study st;
    for (int rep = 0; rep < 8; ++rep) run_channel(e.ch, e.gs, samples, rng, st);
    report(e.name, st);
  }
  return 0;
}
