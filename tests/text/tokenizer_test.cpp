#include "dalle/text/tokenizer.h"

#include <set>

#include "test_support.h"

namespace dalle::text {
namespace {

using testing::ScratchDir;

std::vector<std::string> corpus() {
  const std::vector<std::string> colours = {"red", "green", "blue", "yellow", "purple", "white"};
  const std::vector<std::string> items = {"sneaker", "bag", "dress", "trouser", "ankle boot", "shirt"};
  const std::vector<std::string> places = {"on the left", "on the right", "at the top", "at the bottom"};
  std::vector<std::string> captions;
  for (const auto& colour : colours)
    for (const auto& item : items)
      for (const auto& place : places) captions.push_back("a " + colour + " " + item + " " + place);
  return captions;
}

TokenizerConfig small_config() {
  return {.vocab_size = 64, .text_length = 40, .bpe_dropout = 0.5};
}

class TokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Tokenizer::train(corpus(), small_config(), dir_ / "bpe.model");
  }
  Tokenizer load(TokenizerConfig config = small_config()) { return Tokenizer::load(dir_ / "bpe.model", config); }
  ScratchDir dir_;
};

TEST_F(TokenizerTest, EncodesToFixedLengthWithEndAndPadding) {
  const auto tokenizer = load();
  EXPECT_EQ(tokenizer.vocab_size(), 64);
  const auto encoding = tokenizer.encode("a red bag on the left");
  ASSERT_EQ(encoding.ids.size(), 40u);
  EXPECT_FALSE(encoding.truncated);
  EXPECT_EQ(encoding.ids[encoding.length - 1], Tokenizer::kEndId);
  for (size_t i = encoding.length; i < encoding.ids.size(); ++i) EXPECT_EQ(encoding.ids[i], Tokenizer::kPadId);
  for (int64_t i = 0; i + 1 < encoding.length; ++i) {
    EXPECT_GE(encoding.ids[i], 4) << "reserved ids never encode text";
    EXPECT_LT(encoding.ids[i], 64);
  }
}

TEST_F(TokenizerTest, LowercasesAndRoundTrips) {
  const auto tokenizer = load();
  EXPECT_EQ(tokenizer.encode("A RED Bag on the Left").ids, tokenizer.encode("a red bag on the left").ids);
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("A Blue Dress at the top").ids), "a blue dress at the top");
}

TEST_F(TokenizerTest, TruncatesLongCaptionsAndSaysSo) {
  const auto tokenizer = load();
  auto config = small_config();
  config.text_length = 8;
  const auto short_tokenizer = load(config);
  const std::string long_caption = "a red bag on the left and a blue dress on the right and a white shirt";
  EXPECT_FALSE(tokenizer.encode(long_caption).truncated);
  const auto encoding = short_tokenizer.encode(long_caption);
  EXPECT_TRUE(encoding.truncated);
  EXPECT_EQ(encoding.ids.size(), 8u);
  EXPECT_EQ(encoding.length, 8);
  EXPECT_EQ(encoding.ids.back(), Tokenizer::kEndId);
  const std::string kept = short_tokenizer.decode(encoding.ids);
  EXPECT_FALSE(kept.empty());
  EXPECT_EQ(long_caption.rfind(kept, 0), 0u) << "the kept ids are a prefix";
}

TEST_F(TokenizerTest, BpeDropoutVariesSegmentationButNotText) {
  const auto tokenizer = load();
  Tokenizer::seed_dropout(7);
  std::set<std::vector<int64_t>> segmentations;
  const std::string caption = "a purple sneaker at the bottom";
  for (int i = 0; i < 30; ++i) {
    const auto encoding = tokenizer.encode_for_training(caption);
    EXPECT_EQ(tokenizer.decode(encoding.ids), caption);
    segmentations.insert(encoding.ids);
  }
  EXPECT_GT(segmentations.size(), 1u);
  auto no_dropout = small_config();
  no_dropout.bpe_dropout = 0.0;
  EXPECT_EQ(load(no_dropout).encode_for_training(caption).ids, tokenizer.encode(caption).ids);
}

TEST_F(TokenizerTest, DecodeRefusesIdsOutsideTheVocabulary) {
  EXPECT_THROW_WITH(load().decode({5, 64}), Error, "cannot decode id 64", "64 ids");
  EXPECT_THROW_WITH(load().decode({-1}), Error, "cannot decode id -1");
}

TEST(Tokenizer, TrainingErrorsAreClear) {
  ScratchDir dir;
  auto config = small_config();
  EXPECT_THROW_WITH(Tokenizer::train({"", "  "}, config, dir / "m.model"), Error, "no non-empty captions");
  config.vocab_size = 5000;
  EXPECT_THROW_WITH(Tokenizer::train(corpus(), config, dir / "m.model"), Error, "training the tokenizer",
                    "Vocabulary size too high");
  EXPECT_FALSE(std::filesystem::exists(dir / "m.model"));
}

TEST(Tokenizer, LoadRefusesWhatIsNotAModel) {
  ScratchDir dir;
  testing::write_text(dir / "junk.model", "not a protobuf at all");
  EXPECT_THROW_WITH(Tokenizer::load(dir / "junk.model", small_config()), Error, "junk.model",
                    "not a SentencePiece model");
  EXPECT_THROW_WITH(Tokenizer::load(dir / "missing.model", small_config()), Error, "cannot open");
}

}  // namespace
}  // namespace dalle::text
