#pragma once
// The byte-pair merge loop the BPE tokenizers share (CLIP's, min-dalle's).
#include <cstddef>
#include <string>
#include <unordered_map>
#include <vector>

namespace dalle::text {

using MergeRanks = std::unordered_map<std::string, size_t>;  // "left right" -> rank, lowest first

// Where a round merges its pair: everywhere (GPT-2, CLIP) or at its first occurrence only
// (min-dalle's TextTokenizer; the same ids for a merges file in training order).
enum class MergeAt { every_occurrence, first_occurrence };

// Merges adjacent `symbols` until no pair has a rank: each round takes the lowest-ranked
// pair, the leftmost of equals.
void apply_merges(std::vector<std::string>& symbols, const MergeRanks& ranks, MergeAt at);

}  // namespace dalle::text
