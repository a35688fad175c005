#include "dalle/data/caption_words.h"

#include <algorithm>
#include <random>
#include <sstream>

#include "dalle/error.h"
#include "dalle/seed.h"

namespace dalle::data {

std::string without_words(const std::string& caption, const std::vector<std::string>& words) {
  std::istringstream in(caption);
  std::string kept;
  for (std::string word; in >> word;) {
    if (std::find(words.begin(), words.end(), word) != words.end()) continue;
    kept += (kept.empty() ? "" : " ") + word;
  }
  return kept;
}

size_t drop_words(std::vector<ImageCaptionExample>& examples, double share, const std::vector<std::string>& words,
                  uint64_t seed, uint64_t stream) {
  if (!(share >= 0.0 && share <= 1.0)) {
    throw Error("word dropout: the share of captions must be between 0 and 1, got " + std::to_string(share));
  }
  size_t changed = 0;
  for (size_t i = 0; i < examples.size(); ++i) {
    std::mt19937_64 rng(mix_seed(seed, stream, i));
    if (std::uniform_real_distribution<double>(0.0, 1.0)(rng) >= share) continue;
    auto shorter = without_words(examples[i].caption, words);
    changed += shorter != examples[i].caption;
    examples[i].caption = std::move(shorter);
  }
  return changed;
}

}  // namespace dalle::data
