#include "dalle/data/caption_words.h"

#include <gtest/gtest.h>

#include "dalle/error.h"

namespace dalle::data {
namespace {

const std::vector<std::string> kColours = {"red", "white", "orange"};

std::vector<ImageCaptionExample> examples_of(size_t count, const std::string& caption) {
  std::vector<ImageCaptionExample> examples(count);
  for (auto& example : examples) example.caption = caption;
  return examples;
}

TEST(CaptionWords, LeavesOutWholeWordsOnly) {
  EXPECT_EQ(without_words("a white shirt at the top and a red bag on the left", kColours),
            "a shirt at the top and a bag on the left");
  EXPECT_EQ(without_words("a reddish shirt", kColours), "a reddish shirt");
  EXPECT_EQ(without_words("  a  white   shirt ", kColours), "a shirt");
  EXPECT_EQ(without_words("red white", kColours), "");
  EXPECT_EQ(without_words("a shirt", {}), "a shirt");
}

TEST(CaptionWords, DropsAboutTheShareAskedAndTheSameOnesForTheSameSeed) {
  auto first = examples_of(2000, "an orange coat on the left");
  const auto changed = drop_words(first, 0.25, kColours, 7, 3);
  EXPECT_GT(changed, 400u);
  EXPECT_LT(changed, 600u);
  size_t shortened = 0;
  for (const auto& example : first) {
    if (example.caption == "an coat on the left") {
      ++shortened;
    } else {
      EXPECT_EQ(example.caption, "an orange coat on the left");
    }
  }
  EXPECT_EQ(shortened, changed);

  auto again = examples_of(2000, "an orange coat on the left");
  drop_words(again, 0.25, kColours, 7, 3);
  auto other_stream = examples_of(2000, "an orange coat on the left");
  drop_words(other_stream, 0.25, kColours, 7, 4);
  size_t same = 0, differs = 0;
  for (size_t i = 0; i < first.size(); ++i) {
    same += again[i].caption == first[i].caption;
    differs += other_stream[i].caption != first[i].caption;
  }
  EXPECT_EQ(same, first.size());
  EXPECT_GT(differs, 0u);
}

TEST(CaptionWords, DropsNothingAtZeroAndEverythingAtOne) {
  auto none = examples_of(100, "a red bag");
  EXPECT_EQ(drop_words(none, 0.0, kColours, 1, 1), 0u);
  auto all = examples_of(100, "a red bag");
  EXPECT_EQ(drop_words(all, 1.0, kColours, 1, 1), 100u);
  for (const auto& example : all) EXPECT_EQ(example.caption, "a bag");
}

TEST(CaptionWords, RefusesAShareOutsideZeroToOne) {
  auto examples = examples_of(4, "a red bag");
  EXPECT_THROW(drop_words(examples, 1.5, kColours, 1, 1), Error);
  EXPECT_THROW(drop_words(examples, -0.1, kColours, 1, 1), Error);
}

}  // namespace
}  // namespace dalle::data
