#include "dalle/text/yttm_tokenizer.h"

#include <zlib.h>

#include <nlohmann/json.hpp>

#include "test_support.h"

namespace dalle::text {
namespace {

using testing::ScratchDir;

// tests/parity/make_yttm_tokenizer_fixture.py: youtokentome's and rudalle's ids for 4000
// captions under a model the package learnt.
nlohmann::json fixture() {
  gzFile file = gzopen(testing::fixture_path("yttm_tokenizer.json.gz").c_str(), "rb");
  EXPECT_NE(file, nullptr);
  std::string text;
  char buffer[1 << 16];
  for (int read; (read = gzread(file, buffer, sizeof buffer)) > 0;) text.append(buffer, static_cast<size_t>(read));
  gzclose(file);
  return nlohmann::json::parse(text);
}

TEST(YttmTokenizer, MatchesYoutokentomeAndRudalleOnEveryCaption) {
  const auto tokenizer = YttmTokenizer::load(testing::fixture_path("yttm_bpe.model"));
  const auto all = fixture();
  EXPECT_EQ(tokenizer.vocab_size(), all["vocab_size"].get<int64_t>());
  const auto length = all["text_length"].get<int64_t>();
  int64_t mismatches = 0, unknown = 0;
  for (size_t i = 0; i < all["texts"].size(); ++i) {
    const auto text = all["texts"][i].get<std::string>();
    const auto expected = all["encode"][i].get<std::vector<int64_t>>();
    const auto ids = tokenizer.encode(text);
    const auto caption = tokenizer.caption_ids(text, length);
    const bool same = ids == expected && caption == all["caption_ids"][i].get<std::vector<int64_t>>();
    mismatches += !same;
    unknown += std::count(expected.begin(), expected.end(), tokenizer.unknown_id()) > 0;
    EXPECT_TRUE(same) << "'" << text << "'";
    if (mismatches > 5) break;
  }
  EXPECT_EQ(all["texts"].size(), 4000u);
  EXPECT_GT(unknown, 100) << "the fixture exercises unknown characters";
}

TEST(YttmTokenizer, SpecialIdsComeFromTheModelAndCaptionsArePaddedOrCut) {
  const auto tokenizer = YttmTokenizer::load(testing::fixture_path("yttm_bpe.model"));
  EXPECT_EQ(tokenizer.pad_id(), 0);
  EXPECT_EQ(tokenizer.unknown_id(), 1);
  EXPECT_EQ(tokenizer.bos_id(), 2);
  EXPECT_EQ(tokenizer.eos_id(), 3);
  EXPECT_EQ(tokenizer.caption_ids("  ", 4), (std::vector<int64_t>{2, 3, 0, 0}));
  const auto long_caption = tokenizer.caption_ids("красная сумка слева синие кроссовки справа", 5);
  EXPECT_EQ(long_caption.size(), 5u);
  EXPECT_NE(long_caption.back(), tokenizer.eos_id()) << "cut as rudalle cuts: the end of text is lost";
  EXPECT_EQ(tokenizer.encode("Красная сумка"), tokenizer.encode("Красная \t сумка  ")) << "white space only splits";
  EXPECT_EQ(tokenizer.caption_ids("КРАСНАЯ СУМКА", 8), tokenizer.caption_ids("красная сумка", 8));
}

TEST(YttmTokenizer, RefusesFilesThatAreNotModels) {
  ScratchDir dir;
  EXPECT_THROW_WITH(YttmTokenizer::load(dir / "absent.model"), Error, "cannot open");
  for (const auto& [text, why] : {std::pair{"", "character and merge counts"},
                                  std::pair{"2 0\n97 4\n", "character line 2"},
                                  std::pair{"1 1\n97 4\n4 4\n", "merge line 1"},
                                  std::pair{"1 0\n97 4\n", "unknown, pad, BOS and EOS"},
                                  std::pair{"1 0\n97 4\n1 0 2 3\n", "U+2581"}}) {
    testing::write_text(dir / "bad.model", text);
    EXPECT_THROW_WITH(YttmTokenizer::load(dir / "bad.model"), Error, why);
  }
}

}  // namespace
}  // namespace dalle::text
