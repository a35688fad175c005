#include "dalle/data/caption_dataset.h"

#include <torch/torch.h>

#include "dalle/data/image.h"
#include "test_support.h"

namespace dalle::data {
namespace {

using testing::ScratchDir;

class CaptionDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(dir_ / "images");
    for (int i = 0; i < 3; ++i) {
      write_png(dir_ / ("images/" + std::to_string(i) + ".png"), torch::full({3, 8, 12}, 0.25 * i));
    }
  }
  ScratchDir dir_;
};

TEST_F(CaptionDatasetTest, ReadsTsvWithSeveralCaptionsPerImage) {
  testing::write_text(dir_ / "captions.tsv",
                      "images/0.png\ta black square\nimages/1.png\ta dark square\n"
                      "images/0.png\tsomething black\r\n\nimages/2.png\t  grey  \n");
  const auto dataset = ImageCaptionDataset::open(dir_.path());
  ASSERT_EQ(dataset->size(), 3u);
  EXPECT_EQ(dataset->record(0).captions, (std::vector<std::string>{"a black square", "something black"}));
  EXPECT_EQ(dataset->record(2).captions, (std::vector<std::string>{"grey"}));
  const auto report = dataset->report();
  EXPECT_EQ(report.images, 3);
  EXPECT_EQ(report.captions, 4);
}

TEST_F(CaptionDatasetTest, ReadsJsonlWithCaptionListsAndExtraKeys) {
  testing::write_text(dir_ / "captions.jsonl",
                      "{\"image\": \"images/0.png\", \"captions\": [\"one\", \"two\"], \"objects\": []}\n"
                      "{\"image\": \"images/1.png\", \"caption\": \"three\"}\n");
  const auto dataset = ImageCaptionDataset::open(dir_.path());
  ASSERT_EQ(dataset->size(), 2u);
  EXPECT_EQ(dataset->record(0).captions, (std::vector<std::string>{"one", "two"}));
}

TEST_F(CaptionDatasetTest, SkipsAndCountsEmptyCaptionsMissingImagesAndMalformedLines) {
  testing::write_text(dir_ / "captions.tsv",
                      "images/0.png\tfine\nimages/1.png\t   \nimages/9.png\tghost\nno tab here\n"
                      "\tno image\nimages/2.png\t\n");
  const auto dataset = ImageCaptionDataset::open(dir_.path());
  EXPECT_EQ(dataset->size(), 1u);
  const auto report = dataset->report();
  EXPECT_EQ(report.skipped_empty_captions, 2);
  EXPECT_EQ(report.skipped_missing_images, 1);
  EXPECT_EQ(report.skipped_malformed_lines, 2);
  EXPECT_THAT(report.summary(), ::testing::HasSubstr("2 empty captions"));
}

TEST_F(CaptionDatasetTest, MalformedJsonLinesAreSkipped) {
  testing::write_text(dir_ / "captions.jsonl",
                      "{\"image\": \"images/0.png\", \"caption\": \"ok\"}\n{not json\n[1, 2]\n"
                      "{\"image\": 3, \"caption\": \"x\"}\n{\"image\": \"images/1.png\"}\n"
                      "{\"image\": \"images/2.png\", \"captions\": [\"\", 4]}\n"
                      "{\"image\": \"images/1.png\", \"caption\": 5, \"captions\": [\"five\"]}\n");
  const auto dataset = ImageCaptionDataset::open(dir_.path());
  EXPECT_EQ(dataset->size(), 2u);
  EXPECT_EQ(dataset->report().skipped_malformed_lines, 4);
  EXPECT_EQ(dataset->report().skipped_empty_captions, 3);
}

TEST_F(CaptionDatasetTest, CorruptImagesAreSkippedAndCountedWhenLoaded) {
  testing::write_text(dir_ / "images/1.png", "corrupt");
  testing::write_text(dir_ / "captions.tsv", "images/0.png\ta\nimages/1.png\tb\n");
  const auto dataset = ImageCaptionDataset::open(dir_.path());
  std::mt19937_64 rng(0);
  EXPECT_TRUE(dataset->get(0, rng).has_value());
  EXPECT_FALSE(dataset->get(1, rng).has_value());
  EXPECT_EQ(dataset->report().skipped_unreadable_images, 1);
}

TEST_F(CaptionDatasetTest, CropsToTheConfiguredSquare) {
  testing::write_text(dir_ / "captions.tsv", "images/2.png\tgrey\n");
  const auto dataset = ImageCaptionDataset::open(dir_.path(), {.image_size = 6});
  std::mt19937_64 rng(0);
  const auto example = dataset->get(0, rng);
  ASSERT_TRUE(example.has_value());
  EXPECT_EQ(example->image.sizes(), (std::vector<int64_t>{3, 6, 6}));
  EXPECT_NEAR(example->image.mean().item<float>(), 0.5f, 1e-2);
  EXPECT_EQ(example->caption, "grey");
}

TEST_F(CaptionDatasetTest, FolderWithoutUsablePairsIsAnError) {
  EXPECT_THROW_WITH(ImageCaptionDataset::open(dir_.path()), Error, "no captions.jsonl or captions.tsv");
  testing::write_text(dir_ / "captions.tsv", "images/0.png\t\n");
  EXPECT_THROW_WITH(ImageCaptionDataset::open(dir_.path()), Error, "no usable image-caption pairs");
  EXPECT_THROW_WITH(ImageCaptionDataset::open(dir_ / "nope"), Error, "no such dataset folder");
}

}  // namespace
}  // namespace dalle::data
