#include "dalle/text/bart_tokenizer.h"

#include <nlohmann/json.hpp>

#include <fstream>

#include "dalle/io/safetensors.h"
#include "test_support.h"

namespace dalle::text {
namespace {

// min-dalle 0.4.11's TextTokenizer on the fixture's captions, under its tiny vocab.json and
// merges.txt (tests/parity/make_mindalle_fixture.py).
std::vector<std::string> captions_of(const io::Safetensors& fixture) {
  return nlohmann::json::parse(fixture.metadata.at("tokenizer.captions")).get<std::vector<std::string>>();
}

class BartTokenizerParity : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const auto& [file, key] : {std::pair{"vocab.json", "tokenizer.vocab_json"},
                                    std::pair{"merges.txt", "tokenizer.merges_txt"}}) {
      std::ofstream(dir_ / file) << fixture_.metadata.at(key);
    }
  }
  std::vector<int64_t> expected(size_t caption) const {
    const auto& offsets = fixture_.tensors.at("tokenizer.offsets");
    const auto ids = fixture_.tensors.at("tokenizer.ids")
                         .slice(0, offsets[static_cast<int64_t>(caption)].item<int64_t>(),
                                offsets[static_cast<int64_t>(caption) + 1].item<int64_t>());
    return {ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel()};
  }
  BartTokenizer load() const { return BartTokenizer::load(dir_ / "vocab.json", dir_ / "merges.txt"); }

  io::Safetensors fixture_ = io::read_safetensors(testing::fixture_path("mindalle_parity.safetensors"));
  testing::ScratchDir dir_;
};

TEST_F(BartTokenizerParity, EncodesEveryCaptionAsMinDalleDoes) {
  const auto tokenizer = load();
  const auto captions = captions_of(fixture_);
  ASSERT_EQ(captions.size(), 6u);
  for (size_t i = 0; i < captions.size(); ++i) {
    // min-dalle names emoji first (the emoji package's table); the name here by hand.
    const auto caption = i == 1 ? std::string("a  dogdog_face and   the cats!") : captions[i];
    EXPECT_EQ(tokenizer.encode(caption), expected(i)) << "caption " << i << ": " << captions[i];
  }
  EXPECT_NE(tokenizer.encode(captions[1]), expected(1)) << "the emoji is dropped, not named";
}

TEST_F(BartTokenizerParity, CaptionRowsAreCutOrPaddedToTheTextLength) {
  const auto tokenizer = load();
  const auto long_ids = expected(5);
  ASSERT_GT(long_ids.size(), 64u);
  const auto the_cat = tokenizer.encode("the cat");  // <s> the cat </s>
  ASSERT_EQ(the_cat.size(), 4u);
  EXPECT_EQ(tokenizer.caption_ids("  the cat  the cat", 8),
            (std::vector<int64_t>{the_cat[0], the_cat[1], the_cat[2], the_cat[1], the_cat[2], the_cat[3], 1, 1}))
      << "padded with 1";
  const std::vector<int64_t> first_64(long_ids.begin(), long_ids.begin() + 64);
  const auto captions = captions_of(fixture_);
  EXPECT_EQ(tokenizer.caption_ids(captions[5]), first_64) << "cut, its </s> lost, as min-dalle's generator does";
}

TEST_F(BartTokenizerParity, AVocabularyWithoutItsSpecialSymbolsIsRefused) {
  std::ofstream(dir_ / "bad.json") << R"({"<s>": 0, "</s>": 2})";
  EXPECT_THROW_WITH(BartTokenizer::load(dir_ / "bad.json", dir_ / "merges.txt"), Error, "bad.json", "no <unk>");
  std::ofstream(dir_ / "broken.json") << "{not json";
  EXPECT_THROW_WITH(BartTokenizer::load(dir_ / "broken.json", dir_ / "merges.txt"), Error, "not a vocab.json");
}

}  // namespace
}  // namespace dalle::text
