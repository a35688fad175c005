#pragma once
// Stochastic rounding of float32 values to a 16-bit type: each value goes to one of its two
// neighbours in that type, the nearer more often, so that the expected value is the value.
// Updates far smaller than a 16-bit weight's spacing then still move it on average, which
// rounding to nearest would drop (DALL-E kept its parameters in 16 bits; this is how weights
// stored so keep small updates without a float32 copy).
#include <ATen/core/Generator.h>
#include <torch/types.h>

#include <cstdint>

namespace dalle::train {

// `values` (float32) rounded stochastically to `dtype` (bfloat16 or float16), with the
// uniform draws taken from `generator` (on the values' device).
torch::Tensor round_stochastically(const torch::Tensor& values, torch::ScalarType dtype, at::Generator& generator);

// A generator on `device` seeded with `seed`: one per rounding, so that a resumed run rounds
// as the uninterrupted one did.
at::Generator rounding_generator(torch::Device device, uint64_t seed);

// Mixes `value` into `seed` (splitmix64): seeds that differ by one give unrelated draws.
uint64_t mix_seed(uint64_t seed, uint64_t value);

}  // namespace dalle::train
