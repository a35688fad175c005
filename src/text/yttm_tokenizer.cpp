#include "dalle/text/yttm_tokenizer.h"

#include <fstream>
#include <queue>
#include <unordered_map>

#include "dalle/error.h"
#include "unicode.h"

namespace dalle::text {
namespace {

constexpr char32_t kWordStart = U'\u2581';
constexpr uint32_t kNotAToken = 0xFFFFFFFF;  // a merged-away node

// youtokentome splits words where C's isspace() is true, and at U+2581.
bool separates_words(char32_t c) { return c == U' ' || (c >= 0x09 && c <= 0x0D) || c == kWordStart; }

uint64_t pair_key(uint32_t left, uint32_t right) { return (uint64_t{left} << 32) | right; }

struct Merge {
  uint32_t left, right, merged;
};

}  // namespace

struct YttmTokenizer::Impl {
  std::unordered_map<char32_t, uint32_t> char_ids;
  std::vector<Merge> merges;
  std::unordered_map<uint64_t, uint32_t> merge_of_pair;  // the last merge listed for a pair wins
  int64_t unknown = 0, pad = 0, bos = 0, eos = 0;

  // One word's ids: the word-start symbol, its characters (a run of unknown ones as one unknown
  // id), merged as youtokentome does.
  void encode_word(std::u32string_view word, std::vector<int64_t>& out) const;
};

void YttmTokenizer::Impl::encode_word(std::u32string_view word, std::vector<int64_t>& out) const {
  struct Node {
    uint32_t token;
    int prev, next;
    bool unknown;
  };
  std::vector<Node> nodes;
  const auto append = [&](uint32_t token, bool is_unknown) {
    const int at = static_cast<int>(nodes.size());
    nodes.push_back({token, at - 1, at + 1, is_unknown});
  };
  append(char_ids.at(kWordStart), false);
  for (size_t i = 0; i < word.size();) {
    const auto known = char_ids.find(word[i]);
    if (known != char_ids.end()) {
      append(known->second, false);
      ++i;
      continue;
    }
    append(kNotAToken, true);
    while (i < word.size() && !char_ids.count(word[i])) ++i;
  }
  nodes.back().next = -1;

  // Lowest merge first, then leftmost: the order of youtokentome's priority queue.
  using Event = std::pair<uint32_t, int>;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue;
  const auto push_pair_at = [&](int at) {
    const Node& left = nodes[static_cast<size_t>(at)];
    if (left.next < 0 || left.unknown || nodes[static_cast<size_t>(left.next)].unknown) return;
    const auto merge = merge_of_pair.find(pair_key(left.token, nodes[static_cast<size_t>(left.next)].token));
    if (merge != merge_of_pair.end()) queue.emplace(merge->second, at);
  };
  for (int at = 0; at + 1 < static_cast<int>(nodes.size()); ++at) push_pair_at(at);
  while (!queue.empty()) {
    const auto [index, at] = queue.top();
    queue.pop();
    Node& left = nodes[static_cast<size_t>(at)];
    const Merge& merge = merges[index];
    if (left.token != merge.left || left.next < 0 || nodes[static_cast<size_t>(left.next)].token != merge.right) {
      continue;  // stale: one side was merged into something else since
    }
    Node& right = nodes[static_cast<size_t>(left.next)];
    const int after = right.next;
    right = {kNotAToken, -1, -1, false};
    left.token = merge.merged;
    left.next = after;
    if (after >= 0) nodes[static_cast<size_t>(after)].prev = at;
    if (left.prev >= 0) push_pair_at(left.prev);
    if (after >= 0) push_pair_at(at);
  }
  for (int at = 0; at >= 0; at = nodes[static_cast<size_t>(at)].next) {
    const Node& node = nodes[static_cast<size_t>(at)];
    out.push_back(node.unknown ? unknown : static_cast<int64_t>(node.token));
  }
}

YttmTokenizer::YttmTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
YttmTokenizer::YttmTokenizer(YttmTokenizer&&) noexcept = default;
YttmTokenizer& YttmTokenizer::operator=(YttmTokenizer&&) noexcept = default;
YttmTokenizer::~YttmTokenizer() = default;

YttmTokenizer YttmTokenizer::load(const std::string& model_path) {
  std::ifstream in(model_path);
  if (!in) throw Error(model_path + ": cannot open the YouTokenToMe model");
  const auto refuse = [&](const std::string& why) {
    return Error(model_path + ": not a YouTokenToMe model (" + why + ")");
  };
  auto impl = std::make_unique<Impl>();
  int64_t chars = -1, merges = -1;
  if (!(in >> chars >> merges) || chars <= 0 || merges < 0 || chars > (1 << 21) || merges > (1 << 24)) {
    throw refuse("its first line must give the character and merge counts");
  }
  for (int64_t i = 0; i < chars; ++i) {
    uint32_t code = 0, id = 0;
    if (!(in >> code >> id) || code > 0x10FFFF) throw refuse("character line " + std::to_string(i + 1));
    impl->char_ids[static_cast<char32_t>(code)] = id;
  }
  impl->merges.reserve(static_cast<size_t>(merges));
  for (int64_t i = 0; i < merges; ++i) {
    Merge merge{};
    if (!(in >> merge.left >> merge.right >> merge.merged)) throw refuse("merge line " + std::to_string(i + 1));
    impl->merge_of_pair[pair_key(merge.left, merge.right)] = static_cast<uint32_t>(i);
    impl->merges.push_back(merge);
  }
  if (!(in >> impl->unknown >> impl->pad >> impl->bos >> impl->eos)) {
    throw refuse("its last line must give the unknown, pad, BOS and EOS ids");
  }
  if (!impl->char_ids.count(kWordStart)) throw refuse("it has no word-start symbol U+2581");
  return YttmTokenizer(std::move(impl));
}

bool YttmTokenizer::recognises(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return false;
  const auto space = line.find(' ');
  const auto digits = [](std::string_view part) {
    return !part.empty() && part.size() < 10 && part.find_first_not_of("0123456789") == std::string_view::npos;
  };
  return space != std::string::npos && digits(std::string_view(line).substr(0, space)) &&
         digits(std::string_view(line).substr(space + 1));
}

std::vector<int64_t> YttmTokenizer::encode(std::string_view text) const {
  const auto codes = decode_utf8(text);
  const std::u32string_view view(codes);
  std::vector<int64_t> ids;
  for (size_t i = 0; i < view.size();) {
    while (i < view.size() && separates_words(view[i])) ++i;
    size_t end = i;
    while (end < view.size() && !separates_words(view[end])) ++end;
    if (end > i) impl_->encode_word(view.substr(i, end - i), ids);
    i = end;
  }
  return ids;
}

std::vector<int64_t> YttmTokenizer::caption_ids(std::string_view caption, int64_t text_length) const {
  const auto& classes = char_classes();
  const auto lowered = classes.lower(decode_utf8(caption));
  size_t first = 0, last = lowered.size();
  while (first < last && classes.space(lowered[first])) ++first;
  while (last > first && classes.space(lowered[last - 1])) --last;
  std::vector<int64_t> ids{impl_->bos};
  for (const auto id : encode(encode_utf8(std::u32string_view(lowered).substr(first, last - first)))) ids.push_back(id);
  ids.push_back(impl_->eos);
  ids.resize(static_cast<size_t>(text_length), impl_->pad);
  return ids;
}

std::vector<int64_t> YttmTokenizer::ruclip_ids(std::string_view text, int64_t context_length) const {
  if (context_length < 2) {
    throw Error("ruCLIP's tokenizer: context_length " + std::to_string(context_length) +
                " leaves no room for BOS and EOS");
  }
  auto ids = encode(encode_utf8(char_classes().lower(decode_utf8(text))));
  if (static_cast<int64_t>(ids.size()) > context_length - 2) ids.resize(static_cast<size_t>(context_length - 2));
  ids.insert(ids.begin(), impl_->bos);
  ids.push_back(impl_->eos);
  ids.resize(static_cast<size_t>(context_length), impl_->pad);
  return ids;
}

int64_t YttmTokenizer::vocab_size() const {
  return static_cast<int64_t>(impl_->char_ids.size() + impl_->merges.size()) + 4;
}
int64_t YttmTokenizer::pad_id() const { return impl_->pad; }
int64_t YttmTokenizer::unknown_id() const { return impl_->unknown; }
int64_t YttmTokenizer::bos_id() const { return impl_->bos; }
int64_t YttmTokenizer::eos_id() const { return impl_->eos; }

}  // namespace dalle::text
