#include "dalle/data/image.h"
#include "dalle/data/image_grid.h"
#include "dalle/data/png_text.h"

#include <torch/torch.h>

#include <opencv2/imgcodecs.hpp>
#include <zlib.h>

#include "test_support.h"

namespace dalle::data {
namespace {

using testing::ScratchDir;

torch::Tensor random_image(int64_t height, int64_t width, uint64_t seed = 0) {
  torch::manual_seed(seed);
  return torch::randint(0, 256, {3, height, width}).to(torch::kFloat32) / 255.0;
}

TEST(Image, PngRoundTripIsExactFor8BitValues) {
  ScratchDir dir;
  const auto image = random_image(17, 23);
  write_png(dir / "x.png", image);
  const auto read = read_image(dir / "x.png");
  EXPECT_EQ(read.sizes(), (std::vector<int64_t>{3, 17, 23}));
  EXPECT_TRUE(torch::allclose(read, image, 0, 1e-6));
}

TEST(Image, PngTextChunksCarryUtf8TextAndLeaveThePixelsAlone) {
  const auto image = random_image(5, 7);
  const std::string text = "{\"prompt\": \"a red bag on the left \u00e9\u4e2d\"}";
  const auto png = png_with_text(encode_png(image), "dalle", text);
  EXPECT_EQ(png_text(png, "dalle"), text);
  EXPECT_EQ(png_text(png, "other"), std::nullopt);
  EXPECT_EQ(png_text(encode_png(image), "dalle"), std::nullopt);
  EXPECT_TRUE(torch::allclose(decode_image(png, "with text"), image, 0, 1e-6));
  // Right after the header, with its length and CRC (libpng only warns about a bad CRC in a text chunk).
  const auto at = png.find("iTXt");
  ASSERT_EQ(at, 8u + 25u + 4u);
  const auto big_endian = [&](size_t from) {
    uint32_t value = 0;
    for (size_t i = 0; i < 4; ++i) value = (value << 8) | static_cast<unsigned char>(png[from + i]);
    return value;
  };
  const auto length = big_endian(at - 4);
  EXPECT_EQ(length, 5 + 5 + text.size());
  EXPECT_EQ(big_endian(at + 4 + length),
            crc32(0, reinterpret_cast<const Bytef*>(png.data() + at), static_cast<uInt>(4 + length)));
  EXPECT_THROW_WITH(png_with_text("not a png", "dalle", text), ImageError, "not a PNG");
  EXPECT_THROW_WITH(png_with_text(encode_png(image), "", text), ImageError, "1 to 79");
  EXPECT_THROW_WITH(png_text(png.substr(0, png.size() / 2), "x"), ImageError, "overruns");
  EXPECT_THROW_WITH(png_text("GIF89a", "x"), ImageError, "not a PNG");
}

TEST(Image, ChannelOrderIsRgb) {
  ScratchDir dir;
  cv::Mat bgr(2, 2, CV_8UC3, cv::Scalar(255, 0, 0));  // pure blue in OpenCV's BGR order
  cv::imwrite(dir / "blue.png", bgr);
  const auto image = read_image(dir / "blue.png");
  EXPECT_FLOAT_EQ(image[0].max().item<float>(), 0.0f);
  EXPECT_FLOAT_EQ(image[2].min().item<float>(), 1.0f);
}

TEST(Image, GreyAnd16BitImagesBecomeRgbInUnitRange) {
  ScratchDir dir;
  cv::imwrite(dir / "grey.png", cv::Mat(3, 4, CV_8UC1, cv::Scalar(51)));
  cv::imwrite(dir / "deep.png", cv::Mat(3, 4, CV_16UC3, cv::Scalar(65535, 0, 32768)));
  const auto grey = read_image(dir / "grey.png");
  EXPECT_EQ(grey.size(0), 3);
  EXPECT_NEAR(grey.mean().item<float>(), 0.2f, 1e-6);
  const auto deep = read_image(dir / "deep.png");
  EXPECT_NEAR(deep[0].mean().item<float>(), 32768.0f / 65535.0f, 1e-6);
  EXPECT_NEAR(deep[2].mean().item<float>(), 1.0f, 1e-6);
}

TEST(Image, ReadsJpeg) {
  ScratchDir dir;
  cv::imwrite(dir / "x.jpg", cv::Mat(8, 8, CV_8UC3, cv::Scalar(10, 128, 240)));
  EXPECT_NEAR(read_image(dir / "x.jpg")[0].mean().item<float>(), 240.0f / 255.0f, 0.02);
}

TEST(Image, CorruptEmptyAndMissingFilesAreNamed) {
  ScratchDir dir;
  testing::write_text(dir / "text.png", "this is not a png");
  EXPECT_THROW_WITH(read_image(dir / "text.png"), ImageError, "text.png", "not a readable image");
  testing::write_text(dir / "empty.png", "");
  EXPECT_THROW_WITH(read_image(dir / "empty.png"), ImageError, "empty.png", "empty file");
  EXPECT_THROW_WITH(read_image(dir / "missing.png"), ImageError, "missing.png", "cannot open");
  write_png(dir / "good.png", random_image(32, 32));
  const std::string png = testing::read_text(dir / "good.png");
  testing::write_text(dir / "cut.png", png.substr(0, png.size() / 3));
  EXPECT_THROW_WITH(read_image(dir / "cut.png"), ImageError, "cut.png");
}

TEST(Image, ResizeAndCropsHaveTheAskedShapes) {
  const auto image = random_image(40, 60);
  EXPECT_EQ(resize(image, 20, 30).sizes(), (std::vector<int64_t>{3, 20, 30}));
  EXPECT_EQ(resize(image, 80, 90).sizes(), (std::vector<int64_t>{3, 80, 90}));
  EXPECT_EQ(resize_shorter_side(image, 20).sizes(), (std::vector<int64_t>{3, 20, 30}));
  EXPECT_EQ(resize_shorter_side(image.transpose(1, 2), 20).sizes(), (std::vector<int64_t>{3, 30, 20}));
  const auto centre = center_crop(image, 20, 20);
  EXPECT_TRUE(torch::equal(centre, image.slice(1, 10, 30).slice(2, 20, 40)));
  EXPECT_THROW(center_crop(image, 50, 10), ImageError);
  EXPECT_THROW(resize(torch::zeros({2, 3}), 4, 4), ImageError);
}

TEST(Image, ShrinkingAveragesInsteadOfAliasing) {
  // A 1-pixel checkerboard must shrink to flat grey, not to one of its phases.
  auto board = (torch::arange(64).view({8, 8}) + torch::arange(64).view({8, 8}).div(8, "floor")).remainder(2);
  auto image = board.to(torch::kFloat32).unsqueeze(0).expand({3, 8, 8}).contiguous();
  EXPECT_NEAR(resize(image, 2, 2).std().item<float>(), 0.0f, 0.02);
  EXPECT_NEAR(resize(image, 2, 2).mean().item<float>(), 0.5f, 0.02);
}

TEST(Image, RandomCropIsReproducibleFromTheSeed) {
  const auto image = random_image(32, 32);
  std::mt19937_64 a(5), b(5), c(6);
  const auto first = random_crop(image, 16, 16, a);
  EXPECT_TRUE(torch::equal(first, random_crop(image, 16, 16, b)));
  bool differs = false;
  for (int i = 0; i < 8 && !differs; ++i) differs = !torch::equal(first, random_crop(image, 16, 16, c));
  EXPECT_TRUE(differs);
}

TEST(Image, GridPlacesTilesAndPrintsLabels) {
  std::vector<torch::Tensor> tiles;
  for (int i = 0; i < 5; ++i) tiles.push_back(torch::full({3, 10, 10}, 0.1 * i));
  const auto plain = make_grid(tiles, {}, {.columns = 3, .padding = 2});
  EXPECT_EQ(plain.sizes(), (std::vector<int64_t>{3, 2 + 2 * 12, 2 + 3 * 12}));
  EXPECT_TRUE(torch::allclose(plain.slice(1, 14, 24).slice(2, 14, 24), torch::full({3, 10, 10}, 0.4)));

  const auto labelled = make_grid(tiles, {"a", "b", "c", "d", "e"}, {.columns = 3, .tile_size = 40});
  EXPECT_GT(labelled.size(1), 2 * 40);
  // The label strip under the first tile holds dark text pixels.
  EXPECT_LT(labelled.slice(1, 42, 56).slice(2, 2, 42).min().item<float>(), 0.5f);
  EXPECT_THROW_WITH(make_grid(tiles, {"only one"}), ImageError, "1 labels for 5 images");
  EXPECT_THROW(make_grid({}), ImageError);
}

}  // namespace
}  // namespace dalle::data
