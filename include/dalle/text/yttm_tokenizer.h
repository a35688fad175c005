#pragma once
// ruDALL-E's caption tokenizer: YouTokenToMe's BPE over the bpe.model file shipped with
// ruDALL-E's weights, giving the ids its prior was trained on. encode() matches the
// youtokentome package's BPE.encode, and caption_ids() what rudalle's generate_images feeds
// its model (tests/parity/make_yttm_tokenizer_fixture.py checks both on 4000 captions).
// ruCLIP, ruDALL-E's reranker, reads its own bpe.model through ruclip_ids().
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dalle::text {

class YttmTokenizer {
 public:
  // A YouTokenToMe model file: its characters, its merges in order, its special ids.
  static YttmTokenizer load(const std::string& model_path);
  // Whether the file starts as a YouTokenToMe model does (two counts on the first line),
  // which tells it from a SentencePiece model.
  static bool recognises(const std::string& path);

  YttmTokenizer(YttmTokenizer&&) noexcept;
  YttmTokenizer& operator=(YttmTokenizer&&) noexcept;
  ~YttmTokenizer();

  // The text's ids as youtokentome gives them: words split at ASCII white space, each
  // starting with U+2581; a run of characters the model does not know is one unknown id;
  // pairs merged lowest merge first, leftmost first.
  std::vector<int64_t> encode(std::string_view text) const;
  // rudalle's caption: lower-cased and stripped as Python does, then BOS, the ids, EOS,
  // padded with the pad id to `text_length`, or cut to it (EOS then lost).
  std::vector<int64_t> caption_ids(std::string_view caption, int64_t text_length) const;
  // What ruclip's RuCLIPProcessor.encode_text (ruclip 0.0.2) gives its CLIP: the text
  // lower-cased as Python does (not stripped), its ids cut to context_length - 2, then BOS,
  // the ids, EOS, padded with the pad id to context_length, so the EOS its CLIP pools at is
  // always there. ruclip writes the literals 2, 3 and 0, youtokentome's default BOS, EOS and
  // pad ids; the model's own are used here. context_length must be at least 2.
  std::vector<int64_t> ruclip_ids(std::string_view text, int64_t context_length) const;

  // Characters, merges and the four special ids.
  int64_t vocab_size() const;
  int64_t pad_id() const;
  int64_t unknown_id() const;
  int64_t bos_id() const;
  int64_t eos_id() const;

 private:
  struct Impl;
  explicit YttmTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dalle::text
