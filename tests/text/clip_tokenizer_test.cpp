#include "dalle/text/clip_tokenizer.h"

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "test_support.h"

namespace dalle::text {
namespace {

using testing::ScratchDir;

nlohmann::json fixture() {
  return nlohmann::json::parse(testing::read_text(testing::fixture_path("clip_tokenizer.json")));
}

// Every text of the fixture gives open_clip's ids, bare and as a padded, cut row.
void expect_open_clip_ids(const ClipTokenizer& tokenizer, const nlohmann::json& expected, const nlohmann::json& all) {
  EXPECT_EQ(tokenizer.vocab_size(), expected["vocab_size"].get<int64_t>());
  EXPECT_EQ(tokenizer.start_id(), expected["start"].get<int64_t>());
  EXPECT_EQ(tokenizer.end_id(), expected["end"].get<int64_t>());
  const auto context = all["context_length"].get<int64_t>();
  for (size_t i = 0; i < all["texts"].size(); ++i) {
    const auto text = all["texts"][i].get<std::string>();
    EXPECT_EQ(tokenizer.encode(text), expected["encode"][i].get<std::vector<int64_t>>()) << "'" << text << "'";
    EXPECT_EQ(tokenizer.tokenize(text, context), expected["tokenize"][i].get<std::vector<int64_t>>())
        << "'" << text << "'";
  }
}

TEST(ClipTokenizer, MatchesOpenClipOnItsOwnMergesFile) {
  const auto all = fixture();
  expect_open_clip_ids(ClipTokenizer::load(testing::fixture_path("clip_bpe_test.txt.gz")), all["test_merges"], all);
}

// CLIP's own vocabulary is not in the repository: DALLE_CLIP_BPE names it, or the clip venv
// of tests/parity/make_clip_fixture.py holds it.
TEST(ClipTokenizer, MatchesOpenClipOnTheReleasedMergesFile) {
  std::string path;
  if (const char* named = std::getenv("DALLE_CLIP_BPE")) path = named;
  const char* home = std::getenv("HOME");
  const std::string in_venv = std::string(home ? home : "") +
                              "/.cache/dalle/clip-venv/lib/python3.11/site-packages/open_clip/bpe_simple_vocab_16e6.txt.gz";
  if (path.empty() && std::filesystem::exists(in_venv)) path = in_venv;
  if (path.empty()) GTEST_SKIP() << "CLIP's bpe_simple_vocab_16e6.txt.gz not found (set DALLE_CLIP_BPE)";
  const auto all = fixture();
  expect_open_clip_ids(ClipTokenizer::load(path), all["real_merges"], all);
}

TEST(ClipTokenizer, ReadsPlainMergesFilesAndRefusesOthers) {
  ScratchDir dir;
  testing::write_text(dir / "plain.txt", "#version: 0.2\nr e\ne d</w>\nre d</w>");
  const auto plain = ClipTokenizer::load(dir / "plain.txt");
  // 512 byte symbols, 3 merges, then start and end of text; "red" is one merged symbol.
  EXPECT_EQ(plain.vocab_size(), 517);
  EXPECT_EQ(plain.encode("RED"), (std::vector<int64_t>{514}));
  EXPECT_EQ(plain.tokenize("red red red", 4), (std::vector<int64_t>{515, 514, 514, 516}));

  testing::write_text(dir / "bad.txt", "#version: 0.2\nr e\nthree symbols here\n");
  EXPECT_THROW_WITH(ClipTokenizer::load(dir / "bad.txt"), Error, "bad.txt:3: expected a merge");
  testing::write_text(dir / "unknown.txt", "#version: 0.2\nre d</w>\n");
  EXPECT_THROW_WITH(ClipTokenizer::load(dir / "unknown.txt"), Error, "joins a symbol no earlier line makes");
  testing::write_text(dir / "empty.txt", "#version: 0.2\n");
  EXPECT_THROW_WITH(ClipTokenizer::load(dir / "empty.txt"), Error, "no merges");
  EXPECT_THROW_WITH(ClipTokenizer::load(dir / "absent.txt.gz"), Error, "absent.txt.gz: cannot open");
  EXPECT_THROW_WITH(plain.tokenize("red", 1), Error, "context_length must be at least 2");
}

}  // namespace
}  // namespace dalle::text
