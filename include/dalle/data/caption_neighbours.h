#pragma once
// The captions of a dataset that differ from a given one in a single span of at most three
// words: "a red shirt on the left" has "a red ankle boot on the left", "a blue shirt on the
// left" and "a red shirt at the top" for neighbours. They are contrastive training's hard
// negatives: a random batch of templated captions seldom holds two that differ in one
// attribute only, so a model can match most of a batch by its easiest attribute.
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dalle/data/caption_dataset.h"

namespace dalle::data {

struct CaptionReference {
  size_t record = 0;   // the dataset's image
  size_t caption = 0;  // which of its captions
};

class CaptionNeighbours {
 public:
  static constexpr int64_t kMaxSpanWords = 3;

  explicit CaptionNeighbours(const ImageCaptionDataset& dataset);

  // A caption of the dataset drawn by `rng` among the neighbours of `caption` (which need
  // not be in the dataset); nullopt when it has none.
  std::optional<CaptionReference> draw(const std::string& caption, std::mt19937_64& rng) const;

  // The share of the dataset's captions that have a neighbour.
  double coverage() const { return coverage_; }

 private:
  // (the words around a span, index into captions_), sorted: a caption's neighbours are
  // among the others filed under one of its keys.
  using Entries = std::vector<std::pair<uint64_t, uint32_t>>;

  std::pair<Entries::const_iterator, Entries::const_iterator> filed_under(uint64_t key) const;

  std::vector<CaptionReference> captions_;
  std::vector<std::vector<std::string>> words_;  // of each of captions_
  Entries entries_;
  double coverage_ = 0.0;
};

// Hard negatives for a batch: for i below share * examples.size(), example size - 1 - i is
// replaced by a neighbour of example i's caption, loaded from `dataset` (the one
// `neighbours` indexed). Draw i is seeded by (seed, stream, i), so the replacements depend
// on the batch's examples and (seed, stream) alone. An example whose caption has no
// neighbour, or whose neighbour's image fails to load, keeps its partner. Returns how many
// were replaced; a share outside [0, 0.5] is refused.
size_t replace_with_neighbours(std::vector<ImageCaptionExample>& examples, double share,
                               const CaptionNeighbours& neighbours, const ImageCaptionDataset& dataset,
                               uint64_t seed, uint64_t stream);

}  // namespace dalle::data
