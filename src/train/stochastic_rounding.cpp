#include "dalle/train/stochastic_rounding.h"

#include <ATen/Context.h>
#include <torch/torch.h>

#include "dalle/error.h"

namespace dalle::train {
namespace {

// The explicit mantissa bits and the smallest normal exponent of a 16-bit type.
struct Format {
  int64_t mantissa_bits, min_exponent;
};

Format format_of(torch::ScalarType dtype) {
  if (dtype == torch::kBFloat16) return {7, -126};
  if (dtype == torch::kFloat16) return {10, -14};
  throw Error("stochastic rounding goes to bfloat16 or float16, not " + std::string(c10::toString(dtype)));
}

}  // namespace

torch::Tensor round_stochastically(const torch::Tensor& values, torch::ScalarType dtype, at::Generator& generator) {
  const auto format = format_of(dtype);
  torch::NoGradGuard no_grad;
  const auto x = values.to(torch::kFloat32);
  // The spacing of `dtype` around each value: 2^(exponent - mantissa bits), the exponent held
  // at the smallest normal one for subnormals (and zero). frexp's exponent is one above floor(log2|x|).
  const auto exponent = std::get<1>(torch::frexp(x)).sub_(1).clamp_min_(format.min_exponent);
  const auto spacing = torch::exp2(exponent.sub_(format.mantissa_bits).to(torch::kFloat32));
  // floor(x / spacing + u), u uniform in [0, 1): up with probability the fraction. Exact in
  // float32: the division and product are by powers of two, the quotient has few bits.
  auto draws = torch::rand(x.sizes(), generator, x.options());
  auto rounded = x.div(spacing).add_(draws).floor_().mul_(spacing);
  // Infinities and NaN stay as they are.
  rounded = torch::where(torch::isfinite(x), rounded, x);
  return rounded.to(dtype);
}

at::Generator rounding_generator(torch::Device device, uint64_t seed) {
  auto generator = at::globalContext().defaultGenerator(device).clone();
  generator.set_current_seed(seed);
  return generator;
}

uint64_t mix_seed(uint64_t seed, uint64_t value) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (value + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace dalle::train
