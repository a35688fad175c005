#include "dalle/models/tiled_upscale.h"

#include <torch/torch.h>

#include "test_support.h"

namespace dalle::models {
namespace {

using testing::relative_error;
using torch::indexing::Slice;

RrdbNet small_net(int64_t scale, int64_t blocks, uint64_t seed = 3) {
  torch::manual_seed(seed);
  RrdbNetConfig config;
  config.scale = scale;
  config.num_feat = 8;
  config.num_block = blocks;
  config.num_grow_ch = 4;
  RrdbNet net(config);
  // Larger dense-block weights than basicsr's start, so the trunk's reach shows in the output.
  torch::NoGradGuard no_grad;
  for (auto& p : net->named_parameters()) {
    if (p.key().find(".rdb") != std::string::npos && p.key().ends_with(".weight")) p.value().mul_(10.0);
  }
  net->eval();
  return net;
}

// A smooth image, so that an output jump between neighbouring pixels is the network's doing.
torch::Tensor smooth_image(int64_t height, int64_t width) {
  const auto y = torch::linspace(0, 1, height).view({1, 1, height, 1});
  const auto x = torch::linspace(0, 1, width).view({1, 1, 1, width});
  return torch::cat({(y * 3 + x).sin() * 0.5 + 0.5, (x * 4 - y).cos() * 0.5 + 0.5, (x * y * 6).sin() * 0.5 + 0.5},
                    1);
}

// Output rows (or columns) where one tile's core ends and the next one's begins.
std::vector<int64_t> seams(int64_t side, int64_t tile, int64_t scale) {
  std::vector<int64_t> out;
  for (int64_t begin = tile; begin < side; begin += tile) out.push_back(begin * scale);
  return out;
}

// Largest jump |y[k] - y[k - 1]| across the given rows of `y` [B, C, H, W] (dim 2) or columns (dim 3).
double jump_at(const torch::Tensor& y, int64_t dim, const std::vector<int64_t>& at) {
  double worst = 0;
  for (int64_t k : at) worst = std::max(worst, (y.select(dim, k) - y.select(dim, k - 1)).abs().max().item<double>());
  return worst;
}

TEST(TiledUpscale, EqualsTheWholeImageWhenTheOverlapCoversTheReceptiveField) {
  // Image sides that are no multiple of the tile, several tiles per side, two images.
  for (int64_t scale : {4, 2, 1}) {
    auto net = small_net(scale, 1);
    const int64_t u = net->config().unshuffle_factor();
    const int64_t overlap = (net->config().receptive_radius() + u - 1) / u * u;
    const int64_t tile = overlap, window = tile + 2 * overlap;
    // Windows slide (each side is longer than a window) and sides are no multiple of the tile.
    const int64_t height = window + tile + 3 * u, width = window + 5 * u;
    ASSERT_NE(height % tile, 0);
    ASSERT_NE(width % tile, 0);
    const auto images = torch::rand({scale == 1 ? 1 : 2, 3, height, width});
    torch::NoGradGuard no_grad;
    const auto whole = net->forward(images);
    const auto tiled = upscale_tiled(*net, images, {.tile = tile, .overlap = overlap, .batch = 3});
    ASSERT_EQ(tiled.sizes(), whole.sizes()) << "x" << scale;
    const double error = relative_error(tiled, whole);
    EXPECT_LT(error, 1e-5) << "x" << scale << " tile " << tile << " overlap " << overlap;
    std::printf("x%lld, %lldx%lld in %lld-pixel tiles, overlap %lld: relative error %.3g\n",
                static_cast<long long>(scale), static_cast<long long>(images.size(2)),
                static_cast<long long>(images.size(3)), static_cast<long long>(tile),
                static_cast<long long>(overlap), error);
  }
}

TEST(TiledUpscale, ASmallerOverlapThanTheReceptiveFieldChangesTheResult) {
  // The control for the test above: the equality comes from the overlap, not from luck.
  auto net = small_net(4, 1);
  const auto images = torch::rand({1, 3, 40, 36});
  torch::NoGradGuard no_grad;
  const auto whole = net->forward(images);
  const auto tiled = upscale_tiled(*net, images, {.tile = 12, .overlap = 2});
  const double error = relative_error(tiled, whole);
  EXPECT_GT(error, 1e-3);
  std::printf("overlap 2 < receptive radius %lld: relative error %.3g\n",
              static_cast<long long>(net->config().receptive_radius()), error);
}

TEST(TiledUpscale, LeavesNoSeams) {
  // Across the rows and columns where tiles meet, the tiled output jumps exactly as the whole
  // image's output does, and no more than it jumps inside the tiles. Without overlap the
  // tiles' borders show.
  auto net = small_net(4, 1);
  const int64_t tile = 20, overlap = net->config().receptive_radius(), height = 83, width = 65;
  ASSERT_GT(std::min(height, width), tile + 2 * overlap) << "the windows must slide";
  const auto images = smooth_image(height, width);
  torch::NoGradGuard no_grad;
  const auto whole = net->forward(images);
  const auto tiled = upscale_tiled(*net, images, {.tile = tile, .overlap = overlap});
  const auto row_seams = seams(height, tile, 4), column_seams = seams(width, tile, 4);
  ASSERT_EQ(row_seams.size(), 4u);
  ASSERT_EQ(column_seams.size(), 3u);
  std::vector<int64_t> inner_rows, inner_columns;
  for (int64_t k = 1; k < height * 4; ++k) {
    if (std::find(row_seams.begin(), row_seams.end(), k) == row_seams.end()) inner_rows.push_back(k);
  }
  for (int64_t k = 1; k < width * 4; ++k) {
    if (std::find(column_seams.begin(), column_seams.end(), k) == column_seams.end()) inner_columns.push_back(k);
  }
  const double seam_jump = std::max(jump_at(tiled, 2, row_seams), jump_at(tiled, 3, column_seams));
  const double inner_jump = std::max(jump_at(tiled, 2, inner_rows), jump_at(tiled, 3, inner_columns));
  EXPECT_NEAR(jump_at(tiled, 2, row_seams), jump_at(whole, 2, row_seams), 1e-5);
  EXPECT_NEAR(jump_at(tiled, 3, column_seams), jump_at(whole, 3, column_seams), 1e-5);
  EXPECT_LE(seam_jump, inner_jump);
  std::printf("largest jump across seams %.4f, inside tiles %.4f\n", seam_jump, inner_jump);

  const auto cut = upscale_tiled(*net, images, {.tile = tile, .overlap = 0});
  EXPECT_GT(std::abs(jump_at(cut, 2, row_seams) - jump_at(whole, 2, row_seams)) +
                std::abs(jump_at(cut, 3, column_seams) - jump_at(whole, 3, column_seams)),
            1e-2)
      << "without overlap the seams should show; the test could not tell";
}

TEST(TiledUpscale, ImagesSmallerThanAWindowAndTileZeroRunWhole) {
  auto net = small_net(2, 1);
  const auto images = torch::rand({1, 3, 10, 6});
  torch::NoGradGuard no_grad;
  const auto whole = net->forward(images);
  EXPECT_LT(relative_error(upscale_tiled(*net, images, {.tile = 0, .overlap = 0}), whole), 1e-6);
  EXPECT_LT(relative_error(upscale_tiled(*net, images, {.tile = 192, .overlap = 24}), whole), 1e-6);
}

TEST(TiledUpscale, MisalignedSizesAreRefused) {
  auto net = small_net(2, 1);
  EXPECT_THROW_WITH(upscale_tiled(*net, torch::rand({1, 3, 9, 8}), {}), Error, "multiples of 2", "9x8");
  EXPECT_THROW_WITH(upscale_tiled(*net, torch::rand({1, 3, 8, 8}), {.tile = 7, .overlap = 2}), Error,
                    "tile (7) and overlap (2) must be multiples of the network's pixel-unshuffle factor 2");
  EXPECT_THROW_WITH(upscale_tiled(*net, torch::rand({3, 8, 8}), {}), Error, "[batch, channels, H, W]");
}

TEST(PadSymmetric, MirrorsWithTheEdgeRepeatedAsRuDallesPadReflect) {
  const auto x = torch::arange(6, torch::kFloat32).view({1, 2, 3});  // rows [0 1 2], [3 4 5]
  const auto padded = pad_symmetric(x, 1, 2, 2, 1);
  // numpy.pad(x, ((1, 2), (2, 1)), 'symmetric')
  const auto expected = torch::tensor({{1, 0, 0, 1, 2, 2},
                                       {1, 0, 0, 1, 2, 2},
                                       {4, 3, 3, 4, 5, 5},
                                       {4, 3, 3, 4, 5, 5},
                                       {1, 0, 0, 1, 2, 2}},
                                      torch::kFloat32)
                            .unsqueeze(0);
  EXPECT_TRUE(torch::equal(padded, expected)) << padded;
  EXPECT_THROW_WITH(pad_symmetric(x, 3, 0, 0, 0), Error, "cannot mirror 3 pixels of a 2x3 image");
}

TEST(SuperResolve, AnySizeComesBackScaledInUnitRangeAndAgreesWithTheWholePaddedImage) {
  auto net = small_net(2, 1);
  const auto image = torch::rand({3, 15, 13});
  const SuperResolveOptions options{.tiles = {.tile = 8, .overlap = 40}, .pad = 5};
  const auto out = super_resolve(*net, image, options);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{3, 30, 26}));
  EXPECT_GE(out.min().item<float>(), 0.0f);
  EXPECT_LE(out.max().item<float>(), 1.0f);
  // The same by hand: mirror by 5 (and 1 more at the bottom and right to reach even sides),
  // upscale whole, crop, clamp.
  torch::NoGradGuard no_grad;
  const auto padded = pad_symmetric(pad_symmetric(image.unsqueeze(0), 5, 5, 5, 5), 0, 1, 0, 1);
  const auto expected =
      net->forward(padded).index({Slice(), Slice(), Slice(10, 40), Slice(10, 36)}).clamp(0.0, 1.0).squeeze(0);
  EXPECT_LT((out - expected).abs().max().item<double>(), 1e-5);
  EXPECT_THROW_WITH(super_resolve(*net, torch::rand({3, 4, 4}), {.pad = 15}), Error, "cannot mirror 15 pixels");
}

}  // namespace
}  // namespace dalle::models
