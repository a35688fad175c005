#pragma once
// Seeds derived from seeds, the same on every machine: the data order, each example's
// random stream and the sampler's draws all come from a few user seeds through mix_seed.
#include <cstdint>

namespace dalle {

// splitmix64: a well-mixed 64-bit value from a counter.
uint64_t mix_seed(uint64_t value);
uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c = 0);

}  // namespace dalle
