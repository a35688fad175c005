#include <torch/torch.h>

#include "dalle/models/attention_mask.h"
#include "dalle/models/sparse_attention.h"
#include "dalle/io/safetensors.h"
#include "test_support.h"

namespace dalle::models {
namespace {

// ruDALL-E's own mask builders (tests/parity/make_rudalle_prior_fixture.py) for 6 text
// tokens on 4x4 and 8x8 grids.
TEST(AttentionMask, MatchesRudalleMasks) {
  const auto fixture = io::read_safetensors(testing::fixture_path("rudalle_masks.safetensors"));
  struct Case {
    std::string name;
    MaskSpec spec;
  };
  int checked = 0;
  for (int64_t grid : {4, 8}) {
    std::vector<Case> cases = {{"row", {.kind = AttentionKind::row}}, {"col", {.kind = AttentionKind::column}}};
    for (int64_t kernel : {3, 5, 11}) {
      cases.push_back({"conv_v3_k" + std::to_string(kernel),
                       {.kind = AttentionKind::convolutional, .conv_kernel = kernel, .conv_edges = ConvEdges::clamped}});
      cases.push_back({"conv_v2_k" + std::to_string(kernel),
                       {.kind = AttentionKind::convolutional, .conv_kernel = kernel, .conv_edges = ConvEdges::wrap}});
    }
    for (const auto& [name, spec] : cases) {
      const auto key = "t6_w" + std::to_string(grid) + "." + name;
      if (!fixture.tensors.contains(key)) continue;
      const auto expected = fixture.tensors.at(key).to(torch::kBool);
      EXPECT_TRUE(torch::equal(dense_mask(spec, {.text_length = 6, .grid_size = grid}), expected)) << key;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 14);
}

TEST(AttentionMask, RowColumnAndConvNeighbourhoods) {
  const SequenceLayout layout{.text_length = 3, .grid_size = 5};
  const int64_t center = 3 + 2 * 5 + 2;  // image cell (2, 2)
  auto visible_cells = [&](const MaskSpec& spec) {
    int64_t count = 0;
    for (int64_t key = 3; key < layout.length(); ++key) count += attends(spec, layout, center, key);
    return count;
  };
  EXPECT_EQ(visible_cells({.kind = AttentionKind::row}), 6);     // itself and the previous 5
  EXPECT_EQ(visible_cells({.kind = AttentionKind::column}), 3);  // rows 0, 1, 2 of column 2
  EXPECT_EQ(visible_cells({.kind = AttentionKind::convolutional, .conv_kernel = 3}), 5);  // 3 above, 1 left, itself
  EXPECT_EQ(visible_cells({.kind = AttentionKind::causal}), 13);
  for (int64_t key = 0; key < 3; ++key) EXPECT_TRUE(attends({.kind = AttentionKind::row}, layout, center, key));
  EXPECT_FALSE(attends({.kind = AttentionKind::causal}, layout, 1, 2));  // text is causal
}

// The mask rudalle 1.1.3's DalleTransformer hands each layer, for 1 to 16 layers.
TEST(AttentionMask, RudallePatternMatchesThePackageForEveryLayerCount) {
  const auto fixture = io::read_safetensors(testing::fixture_path("rudalle_masks.safetensors"));
  const AttentionKind codes[] = {AttentionKind::row, AttentionKind::column, AttentionKind::convolutional};
  for (int64_t layers = 1; layers <= 16; ++layers) {
    const auto theirs = fixture.tensors.at("pattern.layers_" + std::to_string(layers)).to(torch::kInt64);
    ASSERT_EQ(theirs.numel(), layers);
    std::vector<AttentionKind> expected;
    for (int64_t i = 0; i < layers; ++i) expected.push_back(codes[theirs[i].item<int64_t>()]);
    EXPECT_EQ(rudalle_layer_pattern(layers), expected) << layers << " layers";
  }
}

TEST(AttentionMask, LayerPatterns) {
  // The paper (0-based): column when (i - 1) % 4 == 0, the last conv, the rest row.
  const auto pattern = dalle_layer_pattern(24);
  for (int64_t i = 0; i < 24; ++i) {
    const auto expected = i == 23 ? AttentionKind::convolutional
                          : (i - 1) % 4 == 0 ? AttentionKind::column
                                             : AttentionKind::row;
    EXPECT_EQ(pattern[i], expected) << i;
  }
  EXPECT_EQ(layer_pattern({}, 6, "dalle").back(), AttentionKind::convolutional);
  EXPECT_EQ(layer_pattern({}, 6, "rudalle").back(), AttentionKind::column);
  EXPECT_EQ(layer_pattern({}, 24, "rudalle"), pattern) << "the released sizes end with conv either way";
  EXPECT_EQ(layer_pattern({"causal"}, 3, "rudalle"), std::vector<AttentionKind>(3, AttentionKind::causal));
  EXPECT_EQ(layer_pattern({"row", "conv"}, 2, "dalle")[1], AttentionKind::convolutional);
  EXPECT_THROW_WITH(layer_pattern({"row", "row", "conv"}, 4, "dalle"), Error, "names 3 layers but the model has 4");
  EXPECT_THROW_WITH(layer_pattern({}, 4, "cogview"), Error, "expected dalle or rudalle");
  EXPECT_THROW_WITH(parse_attention_kind("diagonal"), Error, "causal, row, column or conv");
}

TEST(SparseAttention, PlansTakeTheNarrowestBlocks) {
  const SequenceLayout layout{.text_length = 4, .grid_size = 8};
  const LayerMask row({.kind = AttentionKind::row}, layout);
  EXPECT_FALSE(row.plan().column_blocks);
  EXPECT_EQ(row.plan().window_blocks(), 2);  // the previous row and its own
  const LayerMask column({.kind = AttentionKind::column}, layout);
  EXPECT_TRUE(column.plan().column_blocks);
  EXPECT_EQ(column.plan().window_blocks(), 1);
  const LayerMask conv({.kind = AttentionKind::convolutional, .conv_kernel = 5}, layout);
  EXPECT_EQ(conv.plan().window_blocks(), 3);
  EXPECT_EQ(conv.plan().bias.sizes(), (std::vector<int64_t>{8, 8, 24}));
}

class SparseAgreesWithDense : public ::testing::TestWithParam<MaskSpec> {};

TEST_P(SparseAgreesWithDense, OutputsAndGradients) {
  torch::manual_seed(0);
  const LayerMask mask(GetParam(), {.text_length = 5, .grid_size = 6});
  const int64_t length = mask.layout().length();
  auto make = [&] { return torch::randn({2, 3, length, 8}, torch::requires_grad()); };
  const auto q = make(), k = make(), v = make();
  const auto weights = torch::randn({2, 3, length, 8});
  const auto sparse = masked_attention(q, k, v, mask, 0, AttentionPath::sparse);
  const auto sparse_grads = torch::autograd::grad({(sparse * weights).sum()}, {q, k, v});
  const auto dense = masked_attention(q, k, v, mask, 0, AttentionPath::dense);
  const auto dense_grads = torch::autograd::grad({(dense * weights).sum()}, {q, k, v});
  EXPECT_LT(testing::relative_error(sparse, dense), 1e-5);
  for (size_t i = 0; i < 3; ++i) EXPECT_LT(testing::relative_error(sparse_grads[i], dense_grads[i]), 1e-5) << i;
}

INSTANTIATE_TEST_SUITE_P(
    Masks, SparseAgreesWithDense,
    ::testing::Values(MaskSpec{.kind = AttentionKind::causal}, MaskSpec{.kind = AttentionKind::row},
                      MaskSpec{.kind = AttentionKind::column},
                      MaskSpec{.kind = AttentionKind::convolutional, .conv_kernel = 3},
                      MaskSpec{.kind = AttentionKind::convolutional, .conv_kernel = 5},
                      MaskSpec{.kind = AttentionKind::convolutional, .conv_kernel = 3, .conv_edges = ConvEdges::wrap}),
    [](const auto& info) {
      return to_string(info.param.kind) + std::to_string(info.param.conv_kernel) +
             (info.param.conv_edges == ConvEdges::wrap ? "wrap" : "");
    });

}  // namespace
}  // namespace dalle::models
