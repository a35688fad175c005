#include "dalle/data/caption_neighbours.h"

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>

#include "dalle/data/sampler.h"
#include "dalle/error.h"

namespace dalle::data {
namespace {

std::vector<std::string> words_of(const std::string& caption) {
  std::istringstream in(caption);
  std::vector<std::string> words;
  for (std::string word; in >> word;) words.push_back(word);
  return words;
}

// FNV-1a, written out so that the index (and so the draws) are the same on every machine.
uint64_t fnv1a(uint64_t hash, const std::string& text) {
  for (const unsigned char c : text) hash = (hash ^ c) * 0x100000001b3ULL;
  return hash;
}

// One key per span of 1 to kMaxSpanWords words that leaves a word around it: the words
// before and after it. Captions that differ in that span alone share its key; so can some
// that do not ("on the left" and "on the left side", hash collisions), which
// differ_in_one_span screens out.
std::vector<uint64_t> span_keys(const std::vector<std::string>& words) {
  std::vector<uint64_t> keys;
  const auto count = static_cast<int64_t>(words.size());
  for (int64_t begin = 0; begin < count; ++begin) {
    for (int64_t length = 1; length <= CaptionNeighbours::kMaxSpanWords && begin + length <= count; ++length) {
      if (length == count) continue;  // captions with no word in common are not neighbours
      uint64_t hash = 0xcbf29ce484222325ULL;
      for (int64_t i = 0; i < begin; ++i) hash = fnv1a(hash, words[static_cast<size_t>(i)] + ' ');
      hash = fnv1a(hash, "\x1f");
      for (int64_t i = begin + length; i < count; ++i) hash = fnv1a(hash, words[static_cast<size_t>(i)] + ' ');
      keys.push_back(hash);
    }
  }
  return keys;
}

// Whether `a` and `b` differ in one span of at most kMaxSpanWords words of each, and share
// the words around it.
bool differ_in_one_span(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  if (a == b) return false;
  size_t prefix = 0;
  while (prefix < a.size() && prefix < b.size() && a[prefix] == b[prefix]) ++prefix;
  size_t suffix = 0;
  while (suffix < a.size() - prefix && suffix < b.size() - prefix &&
         a[a.size() - 1 - suffix] == b[b.size() - 1 - suffix]) {
    ++suffix;
  }
  const auto span_a = a.size() - prefix - suffix, span_b = b.size() - prefix - suffix;
  const auto most = static_cast<size_t>(CaptionNeighbours::kMaxSpanWords);
  return prefix + suffix > 0 && span_a >= 1 && span_b >= 1 && span_a <= most && span_b <= most;
}

}  // namespace

CaptionNeighbours::CaptionNeighbours(const ImageCaptionDataset& dataset) {
  for (size_t record = 0; record < dataset.size(); ++record) {
    for (size_t caption = 0; caption < dataset.record(record).captions.size(); ++caption) {
      captions_.push_back({record, caption});
      words_.push_back(words_of(dataset.record(record).captions[caption]));
    }
  }
  if (captions_.size() > std::numeric_limits<uint32_t>::max()) {
    throw Error(dataset.root() + ": too many captions to index their neighbours");
  }
  for (uint32_t i = 0; i < captions_.size(); ++i) {
    for (const auto key : span_keys(words_[i])) entries_.emplace_back(key, i);
  }
  std::sort(entries_.begin(), entries_.end());

  std::map<std::vector<std::string>, bool> has_neighbour;  // per distinct caption
  int64_t covered = 0;
  for (const auto& words : words_) {
    auto [it, added] = has_neighbour.try_emplace(words, false);
    if (added) {
      for (const auto key : span_keys(words)) {
        const auto filed = filed_under(key);
        it->second = std::any_of(filed.first, filed.second,
                                 [&](const auto& entry) { return differ_in_one_span(words, words_[entry.second]); });
        if (it->second) break;
      }
    }
    covered += it->second;
  }
  coverage_ = words_.empty() ? 0.0 : static_cast<double>(covered) / static_cast<double>(words_.size());
}

std::pair<CaptionNeighbours::Entries::const_iterator, CaptionNeighbours::Entries::const_iterator>
CaptionNeighbours::filed_under(uint64_t key) const {
  return std::equal_range(entries_.begin(), entries_.end(), std::pair{key, uint32_t{0}},
                          [](const auto& a, const auto& b) { return a.first < b.first; });
}

std::optional<CaptionReference> CaptionNeighbours::draw(const std::string& caption, std::mt19937_64& rng) const {
  const auto words = words_of(caption);
  // A span first, then a caption filed under it: drawing among all the filed captions at
  // once would favour the spans that change most (colour and item together) over those
  // that change one attribute.
  auto keys = span_keys(words);
  for (size_t keys_left = keys.size(); keys_left > 0; --keys_left) {
    std::swap(keys[static_cast<size_t>(rng() % keys_left)], keys[keys_left - 1]);
    const auto range = filed_under(keys[keys_left - 1]);
    std::vector<uint32_t> filed;
    for (auto it = range.first; it != range.second; ++it) filed.push_back(it->second);
    // Without replacement until one differs: copies of `caption` can be most of them.
    for (size_t left = filed.size(); left > 0; --left) {
      const auto pick = static_cast<size_t>(rng() % left);
      if (differ_in_one_span(words, words_[filed[pick]])) return captions_[filed[pick]];
      filed[pick] = filed[left - 1];
    }
  }
  return std::nullopt;
}

size_t replace_with_neighbours(std::vector<ImageCaptionExample>& examples, double share,
                               const CaptionNeighbours& neighbours, const ImageCaptionDataset& dataset,
                               uint64_t seed, uint64_t stream) {
  if (!(share >= 0.0 && share <= 0.5)) {
    throw Error("hard negatives: the share replaced must be between 0 and 0.5 (each replaced example needs a "
                "partner that is not replaced), got " + std::to_string(share));
  }
  const auto count = static_cast<size_t>(share * static_cast<double>(examples.size()));
  size_t replaced = 0;
  for (size_t i = 0; i < count; ++i) {
    std::mt19937_64 rng(mix_seed(seed, stream, i));
    const auto neighbour = neighbours.draw(examples[i].caption, rng);
    if (!neighbour) continue;
    if (auto example = dataset.get(neighbour->record, neighbour->caption, rng)) {
      examples[examples.size() - 1 - i] = std::move(*example);
      ++replaced;
    }
  }
  return replaced;
}

}  // namespace dalle::data
