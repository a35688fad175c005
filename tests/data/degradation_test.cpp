#include "dalle/data/degradation.h"

#include <torch/torch.h>

#include "dalle/config.h"
#include "test_support.h"

namespace dalle::data {
namespace {

// A picture with edges and texture, so that each stage leaves a mark.
torch::Tensor picture(int64_t height, int64_t width) {
  torch::manual_seed(5);
  const auto y = torch::linspace(0, 1, height).view({1, height, 1});
  const auto x = torch::linspace(0, 1, width).view({1, 1, width});
  const auto plane = torch::zeros({1, height, width});
  auto image = torch::cat({(x * 9).sin() * 0.4 + 0.5 + plane, (y * 7 + x).cos() * 0.4 + 0.5,
                           ((x - y) * 5).sin() * 0.4 + 0.5});
  image.index_put_({torch::indexing::Slice(), torch::indexing::Slice(height / 4, height / 2),
                    torch::indexing::Slice(width / 4, width / 2)},
                   0.9);
  return (image + torch::rand(image.sizes()) * 0.05).clamp(0.0, 1.0);
}

double max_difference(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// No blur, no noise, no JPEG: only the downscaling and the 8-bit rounding.
DegradationDraw plain(const std::string& interpolation = "area") {
  DegradationDraw draw;
  draw.interpolation = interpolation;
  return draw;
}

TEST(Degradation, ASeedFixesTheResultAndSizesFollowTheScale) {
  const auto image = picture(64, 48);
  const DegradationConfig config;
  for (int64_t scale : {1, 2, 4}) {
    std::mt19937_64 a(11), b(11), c(12);
    const auto first = degrade(image, scale, config, a);
    EXPECT_EQ(first.sizes(), (std::vector<int64_t>{3, 64 / scale, 48 / scale})) << scale;
    EXPECT_TRUE(torch::equal(first, degrade(image, scale, config, b))) << "same seed, same image; scale " << scale;
    EXPECT_FALSE(torch::equal(first, degrade(image, scale, config, c))) << "another seed; scale " << scale;
    EXPECT_GE(first.min().item<double>(), 0.0);
    EXPECT_LE(first.max().item<double>(), 1.0);
    EXPECT_LT((first * 255 - (first * 255).round()).abs().max().item<double>(), 1e-3) << "8-bit levels";
  }
  std::mt19937_64 rng(0);
  EXPECT_THROW_WITH(degrade(picture(30, 32), 4, config, rng), Error, "30x32 must be multiples of the scale 4");
  EXPECT_THROW_WITH(degrade(torch::rand({30, 32}), 2, config, rng), Error, "[channels, H, W]");
}

TEST(Degradation, AreaDownscalingAlonePreservesBlockMeans) {
  const auto image = picture(32, 32);
  const auto low = degrade(image, 2, plain("area"));
  const auto means = torch::avg_pool2d(image.unsqueeze(0), 2).squeeze(0);
  EXPECT_LE(max_difference(low, means), 0.5 / 255 + 1e-6) << "block means, rounded to 8 bits";
  for (const char* interpolation : {"bilinear", "bicubic", "nearest"}) {
    EXPECT_EQ(degrade(image, 2, plain(interpolation)).sizes(), low.sizes()) << interpolation;
  }
  EXPECT_GT(max_difference(degrade(image, 2, plain("nearest")), low), 2.0 / 255)
      << "nearest picks pixels, area averages them";
}

TEST(Degradation, EveryStageLeavesItsMark) {
  const auto image = picture(64, 64);
  const auto reference = degrade(image, 2, plain());
  auto blurred = plain();
  blurred.blur_sigma = 2.0;
  // Blur takes out the fine detail: the energy of second differences drops.
  const auto detail = [](const torch::Tensor& x) {
    return x.diff(1, 2).diff(1, 2).pow(2).mean().item<double>() + x.diff(1, 1).diff(1, 1).pow(2).mean().item<double>();
  };
  EXPECT_LT(detail(degrade(image, 2, blurred)), 0.5 * detail(reference));

  // Noise of sigma 20 levels on a flat grey image: its standard deviation is about 20 / 255.
  const auto grey = torch::full({3, 64, 64}, 0.5);
  auto noisy = plain();
  noisy.noise_sigma = 20.0;
  noisy.noise_seed = 3;
  const auto with_noise = degrade(grey, 2, noisy);
  EXPECT_NEAR(with_noise.std().item<double>(), 20.0 / 255, 0.1 * 20.0 / 255);
  EXPECT_FALSE(torch::equal(with_noise[0], with_noise[1])) << "colour noise differs per channel";
  noisy.gray_noise = true;
  const auto gray = degrade(grey, 2, noisy);
  EXPECT_TRUE(torch::equal(gray[0], gray[1]) && torch::equal(gray[1], gray[2])) << "grey noise is one image";

  // Stronger JPEG compression moves the image further.
  auto light = plain(), heavy = plain();
  light.jpeg_quality = 95;
  heavy.jpeg_quality = 10;
  const double light_error = max_difference(degrade(image, 2, light), reference);
  const double heavy_error = max_difference(degrade(image, 2, heavy), reference);
  EXPECT_GT(light_error, 0.0);
  EXPECT_GT(heavy_error, 2 * light_error);
}

TEST(Degradation, DrawsStayWithinTheConfiguredRanges) {
  DegradationConfig config;
  config.blur_probability = 0.5;
  config.blur_sigma = {0.5, 1.5};
  config.interpolations = {"bilinear", "nearest"};
  config.noise_probability = 0.0;
  config.jpeg_quality = {40, 60};
  std::mt19937_64 rng(1);
  int blurred = 0;
  std::set<std::string> interpolations;
  for (int i = 0; i < 400; ++i) {
    const auto draw = draw_degradation(config, rng);
    if (draw.blur_sigma > 0) {
      ++blurred;
      EXPECT_GE(draw.blur_sigma, 0.5);
      EXPECT_LE(draw.blur_sigma, 1.5);
    }
    EXPECT_EQ(draw.noise_sigma, 0.0) << "noise_probability 0";
    EXPECT_GE(draw.jpeg_quality, 40);
    EXPECT_LE(draw.jpeg_quality, 60);
    interpolations.insert(draw.interpolation);
  }
  EXPECT_GT(blurred, 150);
  EXPECT_LT(blurred, 250);
  EXPECT_EQ(interpolations, (std::set<std::string>{"bilinear", "nearest"}));
}

TEST(Degradation, BadSettingsAreRefusedByKey) {
  DegradationConfig config;
  config.noise_sigma = {10, 5};
  EXPECT_THROW_WITH(config.validate(), ConfigError, "degradation.noise_sigma: min (10", "is above max (5");
  config = {};
  config.jpeg_quality = {0, 90};
  EXPECT_THROW_WITH(config.validate(), ConfigError, "degradation.jpeg_quality must lie within [1");
  config = {};
  config.interpolations = {};
  EXPECT_THROW_WITH(config.validate(), ConfigError, "degradation.interpolations: name at least one");
  const auto source = ConfigSource::from_string("interpolations: [area, lanczos]\n", "d.yaml");
  EXPECT_THROW_WITH(load_config<DegradationConfig>(source), ConfigError, "d.yaml", "interpolations", "lanczos");
}

TEST(Degradation, BicubicUpscalingIsTheBaseline) {
  const auto low = torch::rand({2, 3, 8, 6});
  const auto up = bicubic_upscale(low, 2);
  EXPECT_EQ(up.sizes(), (std::vector<int64_t>{2, 3, 16, 12}));
  EXPECT_GE(up.min().item<double>(), 0.0);
  EXPECT_LE(up.max().item<double>(), 1.0);
  // Downscaling a bicubic upscale by area returns close to the input on a smooth image.
  const auto smooth = torch::full({1, 3, 8, 8}, 0.3);
  EXPECT_LT(max_difference(bicubic_upscale(smooth, 4), torch::full({1, 3, 32, 32}, 0.3)), 1e-5);
}

}  // namespace
}  // namespace dalle::data
