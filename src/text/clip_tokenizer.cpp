#include "dalle/text/clip_tokenizer.h"

#include <limits>
#include <unordered_map>
#include <utility>

#include "../io/gzip_file.h"
#include "bpe.h"
#include "unicode.h"
#include "dalle/error.h"

namespace dalle::text {
namespace {

constexpr size_t kMaxMerges = 49152 - 256 - 2;  // CLIP reads this many lines after the header
constexpr std::string_view kEndOfWord = "</w>";
constexpr std::string_view kStart = "<start_of_text>", kEnd = "<end_of_text>";

// html.unescape for the references captions carry: &amp; &lt; &gt; &quot; &apos; &nbsp;
// and numeric ones.
std::u32string unescape_html(const std::u32string& text) {
  static const std::pair<std::u32string_view, char32_t> named[] = {
      {U"amp;", U'&'}, {U"lt;", U'<'}, {U"gt;", U'>'}, {U"quot;", U'"'}, {U"apos;", U'\''}, {U"nbsp;", U'\u00A0'}};
  std::u32string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != U'&') {
      out += text[i];
      continue;
    }
    const auto rest = std::u32string_view(text).substr(i + 1);
    bool replaced = false;
    for (const auto& [name, value] : named) {
      if (rest.substr(0, name.size()) == name) {
        out += value;
        i += name.size();
        replaced = true;
        break;
      }
    }
    if (!replaced && rest.size() > 2 && rest[0] == U'#') {
      const bool hex = rest[1] == U'x' || rest[1] == U'X';
      size_t end = hex ? 2 : 1;
      uint32_t value = 0;
      while (end < rest.size() && end < 10) {
        const char32_t d = rest[end] | 0x20;
        const int digit = (d >= U'0' && d <= U'9') ? int(d - U'0') : (hex && d >= U'a' && d <= U'f') ? int(d - U'a' + 10) : -1;
        if (digit < 0) break;
        value = value * (hex ? 16 : 10) + static_cast<uint32_t>(digit);
        ++end;
      }
      if (end > (hex ? 2u : 1u) && end < rest.size() && rest[end] == U';' && value > 0 && value <= 0x10FFFF) {
        out += static_cast<char32_t>(value);
        i += end + 1;
        replaced = true;
      }
    }
    if (!replaced) out += U'&';
  }
  return out;
}

// open_clip's "lower" cleaning: (ftfy's quote uncurling), html unescaping twice, white
// space runs to one space, trimmed, lowercased.
std::u32string clean(std::string_view text) {
  const auto& classes = char_classes();
  auto codes = decode_utf8(text);
  for (auto& c : codes) {
    if (c == U'\u2018' || c == U'\u2019' || c == U'\u201A' || c == U'\u201B') c = U'\'';
    if (c == U'\u201C' || c == U'\u201D' || c == U'\u201E' || c == U'\u201F') c = U'"';
  }
  codes = unescape_html(unescape_html(codes));
  std::u32string out;
  bool pending_space = false;
  for (const char32_t c : codes) {
    if (classes.space(c)) {
      pending_space = !out.empty();
      continue;
    }
    if (pending_space) out += U' ';
    pending_space = false;
    out += classes.lower(c);
  }
  return out;
}

// CLIP's pre-tokenizer, the regex
// <start_of_text>|<end_of_text>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+
// applied left to right, alternatives in that order.
std::vector<std::u32string> split_words(const std::u32string& text) {
  static const std::u32string_view fixed[] = {U"<start_of_text>", U"<end_of_text>", U"'s", U"'t", U"'re",
                                              U"'ve", U"'m", U"'ll", U"'d"};
  const auto& classes = char_classes();
  std::vector<std::u32string> words;
  const std::u32string_view view(text);
  for (size_t i = 0; i < text.size();) {
    const char32_t c = text[i];
    if (classes.space(c)) {
      ++i;
      continue;
    }
    size_t length = 0;
    for (const auto& literal : fixed) {
      if (view.substr(i, literal.size()) == literal) {
        length = literal.size();
        break;
      }
    }
    if (length == 0) {
      const auto same_kind = [&](char32_t d) {
        if (classes.letter(c)) return classes.letter(d);
        return !classes.space(d) && !classes.letter(d) && !classes.number(d);
      };
      length = 1;
      if (!classes.number(c)) {
        while (i + length < text.size() && same_kind(text[i + length])) ++length;
      }
    }
    words.emplace_back(view.substr(i, length));
    i += length;
  }
  return words;
}

// GPT-2's table, in vocabulary order: every byte gets a printable symbol, its own where it
// has one (those come first), U+0100 onwards for the rest.
std::vector<std::pair<uint8_t, std::string>> byte_symbols() {
  std::vector<std::pair<uint8_t, std::string>> printable, shifted;
  for (int b = 0; b < 256; ++b) {
    const bool own = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    std::string symbol;
    append_utf8(symbol, own ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + shifted.size()));
    (own ? printable : shifted).emplace_back(static_cast<uint8_t>(b), std::move(symbol));
  }
  printable.insert(printable.end(), shifted.begin(), shifted.end());
  return printable;
}

}  // namespace

struct ClipTokenizer::Impl {
  std::vector<std::string> byte_symbol = std::vector<std::string>(256);  // byte -> its symbol (UTF-8)
  std::unordered_map<std::string, int64_t> ids;                          // symbol -> id
  MergeRanks merge_rank;
  int64_t start_id = 0, end_id = 0;

  std::vector<int64_t> encode_word(const std::u32string& word) const;
};

std::vector<int64_t> ClipTokenizer::Impl::encode_word(const std::u32string& word) const {
  const std::string utf8 = encode_utf8(word);
  if (word == std::u32string(kStart.begin(), kStart.end())) return {start_id};
  if (word == std::u32string(kEnd.begin(), kEnd.end())) return {end_id};

  std::vector<std::string> symbols;
  for (const char byte : utf8) symbols.push_back(byte_symbol[static_cast<unsigned char>(byte)]);
  symbols.back() += kEndOfWord;
  apply_merges(symbols, merge_rank, MergeAt::every_occurrence);
  std::vector<int64_t> out;
  for (const auto& symbol : symbols) out.push_back(ids.at(symbol));
  return out;
}

ClipTokenizer ClipTokenizer::load(const std::string& merges_path) {
  const auto bytes = io::read_maybe_gzipped(merges_path);
  const std::string text(bytes.begin(), bytes.end());
  auto impl = std::make_unique<Impl>();
  const auto symbols = byte_symbols();
  for (size_t i = 0; i < symbols.size(); ++i) {
    impl->byte_symbol[symbols[i].first] = symbols[i].second;
    impl->ids[symbols[i].second] = static_cast<int64_t>(i);
    impl->ids[symbols[i].second + std::string(kEndOfWord)] = static_cast<int64_t>(256 + i);
  }
  size_t line_start = text.find('\n');  // the first line is a version header
  size_t line_number = 1, merges = 0;
  while (line_start != std::string::npos && merges < kMaxMerges) {
    const size_t begin = line_start + 1, end = text.find('\n', begin);
    const std::string line = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    line_start = end;
    ++line_number;
    if (line.empty() && end == std::string::npos) break;
    const size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == line.size() || line.find(' ', space + 1) != std::string::npos) {
      throw Error(merges_path + ":" + std::to_string(line_number) +
                  ": expected a merge, two symbols separated by one space (a CLIP bpe_simple_vocab file)");
    }
    const std::string left = line.substr(0, space), right = line.substr(space + 1);
    if (!impl->ids.count(left) || !impl->ids.count(right)) {
      throw Error(merges_path + ":" + std::to_string(line_number) + ": the merge '" + line +
                  "' joins a symbol no earlier line makes");
    }
    // As CLIP's dictionaries do, a repeated merge or result takes its last line's rank or id.
    impl->merge_rank[line] = merges;
    impl->ids[left + right] = static_cast<int64_t>(512 + merges);
    ++merges;
  }
  if (merges == 0) throw Error(merges_path + ": no merges (expected a CLIP bpe_simple_vocab file)");
  impl->start_id = 512 + static_cast<int64_t>(merges);
  impl->end_id = impl->start_id + 1;
  return ClipTokenizer(std::move(impl));
}

ClipTokenizer::ClipTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ClipTokenizer::ClipTokenizer(ClipTokenizer&&) noexcept = default;
ClipTokenizer& ClipTokenizer::operator=(ClipTokenizer&&) noexcept = default;
ClipTokenizer::~ClipTokenizer() = default;

std::vector<int64_t> ClipTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  for (const auto& word : split_words(clean(text))) {
    for (const int64_t id : impl_->encode_word(word)) ids.push_back(id);
  }
  return ids;
}

std::vector<int64_t> ClipTokenizer::tokenize(std::string_view text, int64_t context_length) const {
  if (context_length < 2) throw Error("CLIP tokenizer: context_length must be at least 2");
  std::vector<int64_t> ids{impl_->start_id};
  for (const int64_t id : encode(text)) ids.push_back(id);
  ids.push_back(impl_->end_id);
  if (static_cast<int64_t>(ids.size()) > context_length) {
    ids.resize(static_cast<size_t>(context_length));
    ids.back() = impl_->end_id;
  }
  ids.resize(static_cast<size_t>(context_length), 0);
  return ids;
}

std::string fill_clip_template(std::string_view templ, std::string_view prompt) {
  const auto at = templ.find("{}");
  if (at == std::string_view::npos || templ.find_first_of("{}", at + 2) != std::string_view::npos ||
      templ.substr(0, at).find_first_of("{}") != std::string_view::npos) {
    throw Error("CLIP template '" + std::string(templ) +
                "' must hold {} once, where the prompt goes, and no other brace");
  }
  const auto& classes = char_classes();
  const auto lowered = classes.lower(decode_utf8(prompt));
  size_t first = 0, last = lowered.size();
  while (first < last && classes.space(lowered[first])) ++first;
  while (last > first && classes.space(lowered[last - 1])) --last;
  return std::string(templ.substr(0, at)) + encode_utf8(std::u32string_view(lowered).substr(first, last - first)) +
         std::string(templ.substr(at + 2));
}

int64_t ClipTokenizer::vocab_size() const { return impl_->end_id + 1; }
int64_t ClipTokenizer::start_id() const { return impl_->start_id; }
int64_t ClipTokenizer::end_id() const { return impl_->end_id; }

}  // namespace dalle::text
