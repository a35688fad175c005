#include "bpe.h"

#include <limits>

namespace dalle::text {

void apply_merges(std::vector<std::string>& symbols, const MergeRanks& ranks, MergeAt at) {
  while (symbols.size() > 1) {
    size_t best_rank = std::numeric_limits<size_t>::max(), best = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const auto rank = ranks.find(symbols[i] + ' ' + symbols[i + 1]);
      if (rank != ranks.end() && rank->second < best_rank) best_rank = rank->second, best = i;
    }
    if (best_rank == std::numeric_limits<size_t>::max()) return;
    const std::string left = symbols[best], right = symbols[best + 1];
    std::vector<std::string> merged(symbols.begin(), symbols.begin() + static_cast<std::ptrdiff_t>(best));
    for (size_t i = best; i < symbols.size(); ++i) {
      const bool merges_here = (i == best || at == MergeAt::every_occurrence) && i + 1 < symbols.size() &&
                               symbols[i] == left && symbols[i + 1] == right;
      merged.push_back(merges_here ? left + right : symbols[i]);
      if (merges_here) ++i;
    }
    symbols = std::move(merged);
  }
}

}  // namespace dalle::text
