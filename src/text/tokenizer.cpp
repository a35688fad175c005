#include "dalle/text/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <fstream>
#include <sstream>

#include "dalle/input_limits.h"
#include "dalle/io/atomic_file.h"
#include "dalle/log.h"

namespace dalle::text {

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

namespace {

class CaptionIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit CaptionIterator(const std::vector<std::string>& captions) : captions_(captions) {}
  bool done() const override { return index_ >= captions_.size(); }
  void Next() override { ++index_; }
  const std::string& value() const override { return captions_[index_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<std::string>& captions_;
  size_t index_ = 0;
};

std::string lowercase_ascii(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

void require_ok(const sentencepiece::util::Status& status, const std::string& what) {
  if (!status.ok()) throw Error(what + ": " + status.ToString());
}

// Warn about truncation a few times, then only count, so a long run's log stays readable.
std::atomic<int64_t> truncation_warnings{0};

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl, TokenizerConfig config)
    : impl_(std::move(impl)), config_(config) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

std::string Tokenizer::normalize(std::string_view caption) const {
  return config_.lowercase ? lowercase_ascii(caption) : std::string(caption);
}

void Tokenizer::train(const std::vector<std::string>& captions, const TokenizerConfig& config,
                      const std::string& model_path, uint32_t seed) {
  std::vector<std::string> normalized;
  normalized.reserve(captions.size());
  for (const auto& caption : captions) {
    if (caption.find_first_not_of(" \t\r\n") == std::string::npos) continue;
    normalized.push_back(config.lowercase ? lowercase_ascii(caption) : caption);
  }
  if (normalized.empty()) throw Error("cannot train a tokenizer: no non-empty captions");
  sentencepiece::SetRandomGeneratorSeed(seed);
  const std::unordered_map<std::string, std::string> options = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(config.vocab_size)},
      {"character_coverage", std::to_string(config.character_coverage)},
      {"pad_id", std::to_string(kPadId)},
      {"unk_id", std::to_string(kUnknownId)},
      {"bos_id", std::to_string(kBeginId)},
      {"eos_id", std::to_string(kEndId)},
      {"num_threads", "2"},
      {"minloglevel", "2"},
  };
  CaptionIterator iterator(normalized);
  std::string model;
  require_ok(sentencepiece::SentencePieceTrainer::Train(options, &iterator, &model),
             "training the tokenizer on " + std::to_string(normalized.size()) + " captions failed");
  io::write_file_atomic(model_path, model);
  auto saved = config;
  save_config(config_path(model_path), visit_of(saved));
}

Tokenizer Tokenizer::load(const std::string& model_path) {
  std::ifstream sidecar(config_path(model_path));
  const auto source = sidecar ? ConfigSource::from_file(config_path(model_path)) : ConfigSource::empty();
  return load(model_path, load_config<TokenizerConfig>(source));
}

Tokenizer Tokenizer::load(const std::string& model_path, const TokenizerConfig& config) {
  auto impl = std::make_unique<Impl>();
  std::ifstream in(model_path, std::ios::binary);
  if (!in) throw Error(model_path + ": cannot open the tokenizer model");
  std::ostringstream bytes;
  bytes << in.rdbuf();
  require_ok(impl->processor.LoadFromSerializedProto(bytes.str()),
             model_path + ": not a SentencePiece model");
  if (impl->processor.pad_id() != kPadId || impl->processor.eos_id() != kEndId) {
    throw Error(model_path + ": the tokenizer must reserve id 0 for padding and 3 for end of text");
  }
  return Tokenizer(std::move(impl), config);
}

void Tokenizer::seed_dropout(uint32_t seed) { sentencepiece::SetRandomGeneratorSeed(seed); }

Tokenizer::Encoding Tokenizer::finish(std::vector<int> pieces, std::string_view caption) const {
  Encoding encoding;
  const auto room = static_cast<size_t>(config_.text_length - 1);  // one id for end of text
  if (pieces.size() > room) {
    encoding.truncated = true;
    if (truncation_warnings.fetch_add(1) < 5) {
      log::warn("caption of ", pieces.size(), " tokens truncated to ", room, ": ", excerpt(caption));
    }
    pieces.resize(room);
  }
  encoding.ids.assign(pieces.begin(), pieces.end());
  encoding.ids.push_back(kEndId);
  encoding.length = static_cast<int64_t>(encoding.ids.size());
  encoding.ids.resize(static_cast<size_t>(config_.text_length), kPadId);
  return encoding;
}

Tokenizer::Encoding Tokenizer::encode(std::string_view caption) const {
  std::vector<int> pieces;
  require_ok(impl_->processor.Encode(normalize(caption), &pieces), "encoding a caption failed");
  return finish(std::move(pieces), caption);
}

Tokenizer::Encoding Tokenizer::encode_for_training(std::string_view caption) const {
  if (config_.bpe_dropout <= 0.0) return encode(caption);
  std::vector<int> pieces;
  require_ok(impl_->processor.SampleEncode(normalize(caption), /*nbest_size=*/-1,
                                           static_cast<float>(config_.bpe_dropout), &pieces),
             "encoding a caption failed");
  return finish(std::move(pieces), caption);
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::vector<int> pieces;
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_size()) {
      throw Error("cannot decode id " + std::to_string(id) + ": the vocabulary has " +
                  std::to_string(vocab_size()) + " ids");
    }
    if (id == kPadId || id == kBeginId || id == kEndId) continue;
    pieces.push_back(static_cast<int>(id));
  }
  std::string text;
  require_ok(impl_->processor.Decode(pieces, &text), "decoding ids failed");
  return text;
}

std::vector<std::string> Tokenizer::pieces(std::string_view caption) const {
  std::vector<std::string> pieces;
  require_ok(impl_->processor.Encode(normalize(caption), &pieces), "encoding a caption failed");
  return pieces;
}

int64_t Tokenizer::vocab_size() const { return impl_->processor.GetPieceSize(); }

}  // namespace dalle::text
