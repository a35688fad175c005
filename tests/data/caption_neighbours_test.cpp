#include "dalle/data/caption_neighbours.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>

#include "dalle/data/image.h"
#include "test_support.h"

namespace dalle::data {
namespace {

using testing::ScratchDir;

// Image i of the dataset, with its captions.
const std::vector<std::vector<std::string>> kCaptions = {
    {"a red shirt on the left"},
    {"a red ankle boot on the left"},  // another item, in two words
    {"a blue shirt on the left"},      // another colour
    {"a red shirt at the top"},        // another position, three words for three
    {"a red shirt on the left"},       // a copy: never a neighbour of its text
    {"a green sandal at the bottom and a red bag on the right"},
    {"red shirt"},                     // two spans away, and no word in common with "a zebra"
    {"a red shirt on the left side"},  // a word more, not another one
    {"a zebra", "a red bag on the left"},
};

class CaptionNeighboursTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(dir_ / "images");
    std::string tsv;
    for (size_t i = 0; i < kCaptions.size(); ++i) {
      const auto name = "images/" + std::to_string(i) + ".png";
      write_png(dir_ / name, torch::full({3, 4, 4}, 0.1 * static_cast<double>(i)));
      for (const auto& caption : kCaptions[i]) tsv += name + "\t" + caption + "\n";
    }
    testing::write_text(dir_ / "captions.tsv", tsv);
    dataset_ = ImageCaptionDataset::open(dir_.path());
  }

  // How often each (image, caption) is drawn as a neighbour of `caption` in `draws` tries.
  std::map<std::pair<size_t, size_t>, int> draw_counts(const std::string& caption, int draws) const {
    const CaptionNeighbours neighbours(*dataset_);
    std::map<std::pair<size_t, size_t>, int> counts;
    for (int seed = 0; seed < draws; ++seed) {
      std::mt19937_64 rng(static_cast<uint64_t>(seed));
      const auto drawn = neighbours.draw(caption, rng);
      EXPECT_TRUE(drawn.has_value()) << caption;
      if (drawn) ++counts[{drawn->record, drawn->caption}];
    }
    return counts;
  }

  ScratchDir dir_;
  std::shared_ptr<ImageCaptionDataset> dataset_;
};

TEST_F(CaptionNeighboursTest, NeighboursDifferInOneSpanOfAtMostThreeWords) {
  const auto counts = draw_counts("a red shirt on the left", 400);
  std::set<std::pair<size_t, size_t>> drawn;
  for (const auto& [reference, count] : counts) drawn.insert(reference);
  EXPECT_EQ(drawn, (std::set<std::pair<size_t, size_t>>{{1, 0}, {2, 0}, {3, 0}, {8, 1}}));
  // The span is drawn before the caption, so the one position neighbour is not swamped by
  // the item and colour ones.
  for (const auto& [reference, count] : counts) EXPECT_GE(count, 40) << reference.first;
}

TEST_F(CaptionNeighboursTest, ACaptionOutsideTheDatasetHasNeighboursInIt) {
  const auto counts = draw_counts("a red pullover on the left", 200);
  std::set<size_t> images;
  for (const auto& [reference, count] : counts) images.insert(reference.first);
  // Not image 3: "pullover on the left" and "shirt at the top" are four words.
  EXPECT_EQ(images, (std::set<size_t>{0, 1, 2, 4, 8}));
}

TEST_F(CaptionNeighboursTest, CaptionsWithoutNeighboursDrawNoneAndAreCounted) {
  const CaptionNeighbours neighbours(*dataset_);
  std::mt19937_64 rng(0);
  EXPECT_FALSE(neighbours.draw(kCaptions[5][0], rng));
  EXPECT_FALSE(neighbours.draw("red shirt", rng));
  EXPECT_FALSE(neighbours.draw("", rng));
  // Images 0-4 and "a red bag on the left" of 10 captions; "a zebra", 5, 6 and 7 have none.
  EXPECT_DOUBLE_EQ(neighbours.coverage(), 0.6);
}

TEST_F(CaptionNeighboursTest, ABatchsLastExamplesBecomeNeighboursOfItsFirst) {
  const CaptionNeighbours neighbours(*dataset_);
  // Images 0 and 5 first (5 has no neighbour), then 6 and 7, which they may replace.
  const auto batch = [&] {
    std::mt19937_64 rng(0);
    std::vector<ImageCaptionExample> examples;
    for (size_t image : {0, 5, 6, 7}) examples.push_back(*dataset_->get(image, 0, rng));
    return examples;
  };
  const std::set<std::string> neighbours_of_0 = {"a red ankle boot on the left", "a blue shirt on the left",
                                                 "a red shirt at the top", "a red bag on the left"};
  auto examples = batch();
  EXPECT_EQ(replace_with_neighbours(examples, 0.5, neighbours, *dataset_, 7, 3), 1u);
  EXPECT_EQ(examples[0].caption, kCaptions[0][0]);
  EXPECT_EQ(examples[1].caption, kCaptions[5][0]);
  EXPECT_EQ(examples[2].caption, kCaptions[6][0]);
  EXPECT_TRUE(neighbours_of_0.contains(examples[3].caption)) << examples[3].caption;
  // The replacement is a whole example: its image is the one its caption belongs to.
  const auto record = static_cast<size_t>(examples[3].index);
  EXPECT_NE(std::find(kCaptions[record].begin(), kCaptions[record].end(), examples[3].caption),
            kCaptions[record].end());
  EXPECT_NEAR(examples[3].image.mean().item<double>(), 0.1 * static_cast<double>(record), 1.0 / 255);

  auto again = batch();
  replace_with_neighbours(again, 0.5, neighbours, *dataset_, 7, 3);
  EXPECT_EQ(again[3].caption, examples[3].caption);
  std::set<std::string> drawn;
  for (uint64_t stream = 0; stream < 100; ++stream) {
    auto other = batch();
    replace_with_neighbours(other, 0.5, neighbours, *dataset_, 7, stream);
    drawn.insert(other[3].caption);
  }
  EXPECT_EQ(drawn, neighbours_of_0);

  auto unchanged = batch();
  EXPECT_EQ(replace_with_neighbours(unchanged, 0.0, neighbours, *dataset_, 7, 3), 0u);
  EXPECT_EQ(unchanged[3].caption, kCaptions[7][0]);
  EXPECT_THROW_WITH(replace_with_neighbours(unchanged, 0.75, neighbours, *dataset_, 7, 3), Error,
                    "between 0 and 0.5", "got 0.75");
}

TEST_F(CaptionNeighboursTest, DatasetLoadsANamedCaption) {
  std::mt19937_64 rng(0);
  EXPECT_EQ(dataset_->get(8, 1, rng)->caption, "a red bag on the left");
  EXPECT_EQ(dataset_->get(8, 0, rng)->caption, "a zebra");
  EXPECT_THROW(dataset_->get(8, 2, rng), std::out_of_range);
}

}  // namespace
}  // namespace dalle::data
