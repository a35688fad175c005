#include "dalle/text/bart_tokenizer.h"

#include <nlohmann/json.hpp>

#include <sstream>
#include <unordered_map>

#include "bpe.h"
#include "dalle/error.h"
#include "../io/gzip_file.h"
#include "unicode.h"

namespace dalle::text {

namespace {

constexpr int64_t kPadId = 1;
constexpr std::string_view kSpaceSymbol = "\xC4\xA0";  // U+0120, GPT-2's symbol for a space

std::string read_text(const std::string& path) {
  const auto bytes = io::read_maybe_gzipped(path);
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace

struct BartTokenizer::Impl {
  std::unordered_map<std::string, int64_t> ids;
  MergeRanks ranks;
  int64_t start_id = 0, end_id = 0, unknown_id = 0;
};

BartTokenizer::BartTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BartTokenizer::BartTokenizer(BartTokenizer&&) noexcept = default;
BartTokenizer& BartTokenizer::operator=(BartTokenizer&&) noexcept = default;
BartTokenizer::~BartTokenizer() = default;

BartTokenizer BartTokenizer::load(const std::string& vocab_path, const std::string& merges_path) {
  auto impl = std::make_unique<Impl>();
  try {
    const auto vocab = nlohmann::json::parse(read_text(vocab_path));
    for (const auto& [symbol, id] : vocab.items()) impl->ids[symbol] = id.get<int64_t>();
  } catch (const nlohmann::json::exception& error) {
    throw Error(vocab_path + ": not a vocab.json of symbols and ids (" + error.what() + ")");
  }
  for (const char* special : {"<s>", "</s>", "<unk>"}) {
    if (!impl->ids.count(special)) throw Error(vocab_path + ": no " + special + " in the vocabulary");
  }
  impl->start_id = impl->ids.at("<s>");
  impl->end_id = impl->ids.at("</s>");
  impl->unknown_id = impl->ids.at("<unk>");
  // As min-dalle's f.read().split("\n")[1:-1]; a later repeat of a pair takes its rank.
  const std::string text = read_text(merges_path);
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  if (!text.empty() && text.back() != '\n') lines.pop_back();  // the piece after the last newline
  for (size_t rank = 1; rank < lines.size(); ++rank) {
    std::istringstream words(lines[rank]);
    std::string left, right, extra;
    if (words >> left >> right && !(words >> extra)) impl->ranks[left + ' ' + right] = rank - 1;
  }
  return BartTokenizer(std::move(impl));
}

std::vector<int64_t> BartTokenizer::encode(std::string_view text) const {
  std::string ascii;
  for (const char32_t c : char_classes().lower(decode_utf8(text))) {
    if (c < 0x80) ascii.push_back(static_cast<char>(c));
  }
  std::vector<int64_t> out{impl_->start_id};
  std::istringstream words(ascii);
  for (std::string word; std::getline(words, word, ' ');) {
    if (word.empty()) continue;
    std::vector<std::string> symbols{std::string(kSpaceSymbol)};
    for (const char c : word) symbols.emplace_back(1, c);
    apply_merges(symbols, impl_->ranks, MergeAt::first_occurrence);
    for (const auto& symbol : symbols) {
      const auto id = impl_->ids.find(symbol);
      out.push_back(id == impl_->ids.end() ? impl_->unknown_id : id->second);
    }
  }
  out.push_back(impl_->end_id);
  return out;
}

std::vector<int64_t> BartTokenizer::caption_ids(std::string_view text, int64_t text_length) const {
  auto ids = encode(text);
  ids.resize(static_cast<size_t>(text_length), kPadId);
  return ids;
}

int64_t BartTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->ids.size()); }

}  // namespace dalle::text
