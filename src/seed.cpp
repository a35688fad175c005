#include "dalle/seed.h"

namespace dalle {

uint64_t mix_seed(uint64_t value) {
  value += 0x9e3779b97f4a7c15ull;
  value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ull;
  value = (value ^ (value >> 27)) * 0x94d049bb133111ebull;
  return value ^ (value >> 31);
}

uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c) { return mix_seed(mix_seed(mix_seed(a) ^ b) ^ c); }

}  // namespace dalle
