#pragma once
// DALL-E Mega / Mini's caption tokenizer, min-dalle 0.4.11's TextTokenizer: BART's
// vocab.json and merges.txt (docs/mega-prior.md, section 7). The caption is lower-cased as
// Python does, every non-ASCII character dropped, split at spaces; each word, with GPT-2's
// space symbol U+0120 in front, is merged pair by pair (the lowest-ranked pair's first
// occurrence each round) and looked up, unknown symbols as <unk>. One difference:
// min-dalle first turns emoji into their names (the `emoji` package's table, which changes
// between its versions); here they are dropped with the other non-ASCII characters.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dalle::text {

class BartTokenizer {
 public:
  // vocab.json (symbol -> id; it must have <s>, </s> and <unk>) and merges.txt, read as
  // min-dalle does: its first line (#version) and its last piece after the final newline
  // are not merges.
  static BartTokenizer load(const std::string& vocab_path, const std::string& merges_path);

  BartTokenizer(BartTokenizer&&) noexcept;
  BartTokenizer& operator=(BartTokenizer&&) noexcept;
  ~BartTokenizer();

  // min-dalle's tokenize(): <s>, the caption's ids, </s>.
  std::vector<int64_t> encode(std::string_view text) const;
  // The caption row min-dalle's generator feeds: encode() cut to `text_length` ids (the
  // </s> is then lost) and padded with <pad> (1).
  std::vector<int64_t> caption_ids(std::string_view text, int64_t text_length = 64) const;
  int64_t vocab_size() const;

 private:
  struct Impl;
  explicit BartTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dalle::text
