#pragma once
// Caption tokenizer: SentencePiece BPE over lowercased captions (as in DALL-E), encoded to a
// fixed number of ids. Ids 0-3 are reserved: padding, unknown, begin and end of text.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dalle/config.h"

namespace dalle::text {

struct TokenizerConfig {
  int64_t vocab_size = 16384;
  int64_t text_length = 256;
  double bpe_dropout = 0.1;
  double character_coverage = 1.0;
  bool lowercase = true;

  void visit(ConfigVisitor& v) {
    v.field("vocab_size", vocab_size, "BPE vocabulary size, the 4 reserved ids included (DALL-E: 16384)",
            {.min = 8, .max = 1 << 20});
    v.field("text_length", text_length,
            "ids per caption after encoding: longer captions are truncated, shorter ones padded (DALL-E: 256)",
            {.min = 2, .max = 1 << 16});
    v.field("bpe_dropout", bpe_dropout,
            "probability of dropping a merge when encoding training captions (DALL-E: 0.1)",
            {.min = 0.0, .max = 1.0});
    v.field("character_coverage", character_coverage,
            "fraction of characters the vocabulary must cover when training",
            {.min = 0.5, .max = 1.0});
    v.field("lowercase", lowercase, "lowercase captions before encoding (DALL-E does)");
  }
};

class Tokenizer {
 public:
  static constexpr int64_t kPadId = 0;
  static constexpr int64_t kUnknownId = 1;
  static constexpr int64_t kBeginId = 2;
  static constexpr int64_t kEndId = 3;

  // Trains a BPE model on `captions` and writes it atomically to `model_path`, with its
  // config beside it as `<model_path>.yaml`.
  static void train(const std::vector<std::string>& captions, const TokenizerConfig& config,
                    const std::string& model_path, uint32_t seed = 0);
  static Tokenizer load(const std::string& model_path, const TokenizerConfig& config);
  // With the config saved beside the model (the defaults when there is none).
  static Tokenizer load(const std::string& model_path);
  static std::string config_path(const std::string& model_path) { return model_path + ".yaml"; }

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  struct Encoding {
    std::vector<int64_t> ids;  // exactly text_length ids: tokens, end of text, padding
    int64_t length = 0;        // tokens before the padding, end of text included
    bool truncated = false;
  };
  // Deterministic encoding, as for sampling and evaluation.
  Encoding encode(std::string_view caption) const;
  // With BPE-dropout at the configured rate, as for training. SentencePiece draws from a
  // per-thread generator seeded by `seed_dropout`, so the ids depend on the thread.
  Encoding encode_for_training(std::string_view caption) const;
  static void seed_dropout(uint32_t seed);

  // Reserved ids are dropped; ids outside the vocabulary are refused.
  std::string decode(const std::vector<int64_t>& ids) const;
  std::vector<std::string> pieces(std::string_view caption) const;

  int64_t vocab_size() const;
  int64_t text_length() const { return config_.text_length; }
  const TokenizerConfig& config() const { return config_; }

 private:
  struct Impl;
  Tokenizer(std::unique_ptr<Impl> impl, TokenizerConfig config);
  Encoding finish(std::vector<int> pieces, std::string_view caption) const;
  std::string normalize(std::string_view caption) const;

  std::unique_ptr<Impl> impl_;
  TokenizerConfig config_;
};

}  // namespace dalle::text
