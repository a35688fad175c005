#include "dalle/models/rrdbnet.h"

#include <torch/torch.h>

#include "dalle/io/checkpoint.h"
#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/trained.h"
#include "test_support.h"

namespace dalle::models {
namespace {

using testing::relative_error;

// The sizes make_rrdbnet_fixture.py builds the references with.
RrdbNetConfig fixture_config(int64_t scale) {
  return {.scale = scale, .num_feat = 8, .num_block = 2, .num_grow_ch = 4};
}

class RrdbNetParity : public ::testing::Test {
 protected:
  // "x<S>": the reference of scale S in the fixture (appended: GCC 12 warns falsely,
  // -Wstringop-overflow, on "literal" + string).
  static std::string key_of(int64_t scale) { return std::string("x").append(std::to_string(scale)); }
  // The state dict of the x`scale` reference, stored under `x<S>.`.
  io::TensorMap weights(int64_t scale) const {
    return testing::dequantized_weights(fixture_.tensors, key_of(scale) + ".");
  }
  RrdbNet loaded(int64_t scale) const {
    RrdbNet model(fixture_config(scale));
    io::load_state_dict(*model, weights(scale), "rrdbnet_parity.safetensors x" + std::to_string(scale));
    model->eval();
    return model;
  }
  const torch::Tensor& at(const std::string& name) const { return fixture_.tensors.at(name); }

  io::Safetensors fixture_ = io::read_safetensors(testing::fixture_path("rrdbnet_parity.safetensors"));
};

TEST_F(RrdbNetParity, ParameterNamesAndShapesAreBasicsrs) {
  for (int64_t scale : {1, 2, 4, 8}) {
    RrdbNet model(fixture_config(scale));
    const auto ours = io::state_dict(*model);
    const auto theirs = weights(scale);
    ASSERT_EQ(ours.size(), theirs.size()) << "x" << scale;
    for (const auto& [name, tensor] : theirs) {
      ASSERT_TRUE(ours.count(name)) << "x" << scale << " " << name;
      EXPECT_EQ(ours.at(name).sizes(), tensor.sizes()) << "x" << scale << " " << name;
    }
    for (const char* name : {"conv_first.weight", "body.0.rdb1.conv1.weight", "body.1.rdb3.conv5.bias",
                             "body.1.rdb2.conv3.weight", "conv_body.weight", "conv_up1.weight", "conv_up2.bias",
                             "conv_hr.weight", "conv_last.bias"}) {
      EXPECT_TRUE(ours.count(name)) << "x" << scale << " " << name;
    }
    EXPECT_EQ(ours.count("conv_up3.weight"), scale == 8 ? 1u : 0u) << "x" << scale;
  }
  // The pixel-unshuffle multiplies conv_first's inputs: 3 * 16 at x1, 3 * 4 at x2.
  EXPECT_EQ(weights(1).at("conv_first.weight").size(1), 48);
  EXPECT_EQ(weights(2).at("conv_first.weight").size(1), 12);
  EXPECT_EQ(weights(4).at("conv_first.weight").size(1), 3);
}

TEST_F(RrdbNetParity, OutputsMatchBasicsrAtScales1To4) {
  torch::NoGradGuard no_grad;
  for (int64_t scale : {1, 2, 4}) {
    const std::string key = key_of(scale);
    const auto out = loaded(scale)->forward(at(key + ".input"));
    ASSERT_EQ(out.sizes(), at(key + ".output").sizes()) << key;
    const double error = relative_error(out, at(key + ".output"));
    EXPECT_LT(error, 1e-4) << key;
    std::printf("%s relative error %.3g\n", key.c_str(), error);
  }
}

TEST_F(RrdbNetParity, OutputMatchesRuDallesX8) {
  torch::NoGradGuard no_grad;
  const auto out = loaded(8)->forward(at("x8.input"));
  ASSERT_EQ(out.sizes(), at("x8.output").sizes());
  const double error = relative_error(out, at("x8.output"));
  EXPECT_LT(error, 1e-4);
  std::printf("x8 relative error %.3g\n", error);
}

TEST_F(RrdbNetParity, TheTrunkMatters) {
  // A check on the fixture itself: zeroing one dense conv of the last block moves the output
  // well beyond the tolerance, so the parity tests see the blocks.
  torch::NoGradGuard no_grad;
  auto model = loaded(4);
  const auto reference = model->forward(at("x4.input"));
  model->named_parameters()["body.1.rdb3.conv5.weight"].zero_();
  EXPECT_GT(relative_error(model->forward(at("x4.input")), reference), 1e-3);
}

TEST_F(RrdbNetParity, MissingUnexpectedAndMisshapenTensorsAreRefusedByName) {
  RrdbNet x2(fixture_config(2));
  EXPECT_THROW_WITH(io::load_state_dict(*x2, weights(4), "RealESRGAN_x4.safetensors"), Error,
                    "RealESRGAN_x4.safetensors", "misshapen: conv_first.weight [8, 3, 3, 3] where the model has [8, 12, 3, 3]");
  RrdbNet x4(fixture_config(4));
  EXPECT_THROW_WITH(io::load_state_dict(*x4, weights(8)), Error, "unexpected: conv_up3.bias, conv_up3.weight");
  RrdbNet x8(fixture_config(8));
  EXPECT_THROW_WITH(io::load_state_dict(*x8, weights(4)), Error, "missing: conv_up3.bias, conv_up3.weight");
  auto config = fixture_config(4);
  config.num_block = 1;
  RrdbNet shorter(config);
  EXPECT_THROW_WITH(io::load_state_dict(*shorter, weights(4)), Error, "unexpected: body.1.rdb1.conv1.bias");
  auto missing = weights(4);
  missing.erase("body.0.rdb2.conv4.weight");
  EXPECT_THROW_WITH(io::load_state_dict(*x4, missing), Error, "missing: body.0.rdb2.conv4.weight");
  config = fixture_config(4);
  config.num_grow_ch = 5;
  RrdbNet wider(config);
  EXPECT_THROW_WITH(io::load_state_dict(*wider, weights(4)), Error,
                    "misshapen: body.0.rdb1.conv1.bias [4] where the model has [5]");
}

TEST_F(RrdbNetParity, ACheckpointAsExportedLoadsAndMatches) {
  // The layout scripts/export_realesrgan.py writes: kind, the model's sizes, the weights
  // under basicsr's names, an empty state.
  testing::ScratchDir dir;
  const std::string sizes = "model:\n  num_in_ch: 3\n  num_out_ch: 3\n  scale: 2\n  num_feat: 8\n  num_grow_ch: 4\n";
  io::save_checkpoint(dir / "x2", {.config_yaml = "kind: rrdbnet\n" + sizes + "  num_block: 2\n", .weights = weights(2)});
  auto model = models::load_trained_rrdbnet(dir / "x2");
  EXPECT_FALSE(model->is_training());
  EXPECT_EQ(model->config().scale, 2);
  torch::NoGradGuard no_grad;
  EXPECT_LT(relative_error(model->forward(at("x2.input")), at("x2.output")), 1e-4);

  io::save_checkpoint(dir / "deeper", {.config_yaml = sizes + "  num_block: 3\n", .weights = weights(2)});
  EXPECT_THROW_WITH(models::load_trained_rrdbnet(dir / "deeper"), Error, "deeper/model.safetensors",
                    "missing: body.2.");
  io::save_checkpoint(dir / "vqgan", {.config_yaml = "kind: vqgan\n" + sizes, .weights = weights(2)});
  EXPECT_THROW_WITH(models::load_trained_rrdbnet(dir / "vqgan"), Error, "vqgan/config.yaml", "kind");
  EXPECT_THROW_WITH(models::load_trained_rrdbnet(dir / "nowhere"), Error, "nowhere",
                    "neither a super-resolution checkpoint nor a run");
}

TEST(RrdbNet, ShapesFollowTheScale) {
  torch::NoGradGuard no_grad;
  for (int64_t scale : {1, 2, 4, 8}) {
    RrdbNet model(fixture_config(scale));
    const auto out = model->forward(torch::rand({2, 3, 8, 12}));
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 3, 8 * scale, 12 * scale})) << "x" << scale;
  }
  RrdbNet x1(fixture_config(1)), x2(fixture_config(2));
  EXPECT_THROW_WITH(x1->forward(torch::rand({1, 3, 8, 10})), Error, "multiples of 4", "8x10");
  EXPECT_THROW_WITH(x2->forward(torch::rand({1, 3, 7, 8})), Error, "multiples of 2", "7x8");
  EXPECT_THROW_WITH(x2->forward(torch::rand({1, 1, 8, 8})), Error, "[batch, 3, H, W]");
  auto config = fixture_config(3);
  EXPECT_THROW_WITH(RrdbNet{config}, Error, "scale must be 1, 2, 4 or 8, got 3");
}

TEST(RrdbNet, FreshDenseBlocksStartNearTheIdentity) {
  // basicsr's initialisation: dense convs are Kaiming normal times 0.1, biases zero.
  torch::manual_seed(0);
  RrdbNet model(fixture_config(4));
  const auto params = model->named_parameters();
  const auto w = params["body.0.rdb1.conv5.weight"];
  const double fan_in = static_cast<double>(w[0].numel());
  EXPECT_NEAR(w.std().item<double>(), 0.1 * std::sqrt(2.0 / fan_in), 0.02 * std::sqrt(2.0 / fan_in));
  EXPECT_EQ(params["body.1.rdb3.conv2.bias"].abs().max().item<double>(), 0.0);
  EXPECT_GT(params["conv_first.bias"].abs().max().item<double>(), 0.0) << "torch's default init outside the blocks";
}

TEST(RrdbNet, ReceptiveFieldStaysWithinTheBound) {
  // Perturb one input pixel: outputs change only within receptive_radius() input pixels of
  // it, and the bound is not loose by more than a few pixels.
  torch::NoGradGuard no_grad;
  for (int64_t scale : {2, 4}) {
    torch::manual_seed(1);
    auto config = fixture_config(scale);
    config.num_block = 1;
    RrdbNet model(config);
    // basicsr's start scales the dense convs by 0.1; the far end of the field then moves
    // the output by less than float rounding. Full-size weights make the whole field show.
    for (auto& p : model->named_parameters()) {
      if (p.key().find(".rdb") != std::string::npos) p.value().mul_(10.0);
    }
    const int64_t radius = config.receptive_radius(), side = 2 * radius + 24, centre = side / 2;
    const auto x = torch::rand({1, 3, side, side});
    auto bumped = x.clone();
    bumped.index_put_({0, torch::indexing::Slice(), centre, centre}, torch::tensor({5.0, -5.0, 5.0}));
    const auto changed = ((model->forward(bumped) - model->forward(x)).abs().amax({0, 1}) > 0).nonzero();
    ASSERT_GT(changed.size(0), 0);
    // Output pixel (i, j) lies over input pixel (i / scale, j / scale).
    const auto reach = (torch::floor_divide(changed, scale) - centre).abs().max().item<int64_t>();
    std::printf("x%lld: reach %lld input pixels, bound %lld\n", static_cast<long long>(scale),
                static_cast<long long>(reach), static_cast<long long>(radius));
    EXPECT_LE(reach, radius) << "x" << scale;
    EXPECT_GE(reach, radius - 3 * config.unshuffle_factor()) << "x" << scale;
  }
}

}  // namespace
}  // namespace dalle::models
