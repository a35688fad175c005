#pragma once
// CLIP's caption tokenizer: byte-level BPE over the merges file OpenAI CLIP and open_clip
// ship (bpe_simple_vocab_16e6.txt.gz), giving the ids their text encoders were trained
// on, so that imported CLIP weights (scripts/export_open_clip.py) can rerank. Ids match
// open_clip's SimpleTokenizer with its default cleaning ("lower") for text that needs no
// ftfy repair; what differs is listed in docs/clip.md.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dalle::text {

class ClipTokenizer {
 public:
  // The merges file, gzipped or not. The vocabulary is the 256 byte symbols, the same with
  // an end-of-word mark, one symbol per merge (at most 48,894 merges are read, as CLIP
  // does), then start and end of text.
  static ClipTokenizer load(const std::string& merges_path);

  ClipTokenizer(ClipTokenizer&&) noexcept;
  ClipTokenizer& operator=(ClipTokenizer&&) noexcept;
  ~ClipTokenizer();

  // The text's ids, without start and end of text.
  std::vector<int64_t> encode(std::string_view text) const;
  // open_clip's tokenize(): start, the ids, end, cut to `context_length` ids (the last of
  // them then end of text) and padded with 0.
  std::vector<int64_t> tokenize(std::string_view text, int64_t context_length = 77) const;

  int64_t vocab_size() const;
  int64_t start_id() const;
  int64_t end_id() const;

 private:
  struct Impl;
  explicit ClipTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One rendering of a prompt for CLIP, as ruclip's Predictor makes them (ruDALL-E's
// cherry_pick_by_ruclip: `template.format(text.lower().strip())`): `templ` with its "{}"
// replaced by `prompt` lower-cased and stripped of white space as Python does. Throws
// unless `templ` holds "{}" once and no other brace (str.format would read those).
std::string fill_clip_template(std::string_view templ, std::string_view prompt);

}  // namespace dalle::text
