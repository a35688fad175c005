#pragma once
// Captions with some words left out, so that a contrastive model also learns what the rest of
// a caption says on its own: "a white shirt at the top" without the colour names is "a shirt
// at the top", which every shirt of the training set matches whatever its colour. A model
// that has never seen a white shirt can then still be asked whether an image shows a shirt.
#include <cstdint>
#include <string>
#include <vector>

#include "dalle/data/caption_dataset.h"

namespace dalle::data {

// `caption` without the words (whole words, split at spaces) that are in `words`, its other
// words joined by single spaces.
std::string without_words(const std::string& caption, const std::vector<std::string>& words);

// Each example's caption becomes without_words(caption, words) with probability `share`,
// drawn from (seed, stream, the example's place in the batch), so that a resumed run drops
// the same words. Returns how many captions changed; a share outside [0, 1] is refused.
size_t drop_words(std::vector<ImageCaptionExample>& examples, double share, const std::vector<std::string>& words,
                  uint64_t seed, uint64_t stream);

}  // namespace dalle::data
