#include "dalle/models/vqgan.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <unordered_set>

#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"
#include "test_support.h"

namespace dalle::models {
namespace {

using testing::relative_error;

// The sizes make_vqgan_fixture.py builds ruDALL-E's GumbelVQ with.
VqganConfig fixture_config() {
  return {.ch = 32, .ch_mult = {1, 2}, .num_res_blocks = 1, .attn_resolutions = {16}, .z_channels = 32, .embed_dim = 32,
          .n_embed = 64, .resolution = 32};
}

// A CPU-fast model: GroupNorm over 4 groups so that widths of 8 are allowed.
VqganConfig tiny_config(const std::string& quantizer = "gumbel") {
  return {.ch = 8, .ch_mult = {1, 2, 2}, .num_res_blocks = 1, .attn_resolutions = {4}, .z_channels = 8, .embed_dim = 8,
          .n_embed = 16, .resolution = 16, .norm_groups = 4, .quantizer = quantizer};
}

class VqganParity : public ::testing::Test {
 protected:
  void SetUp() override {
    weights_ = testing::dequantized_weights(fixture_.tensors);
    model_ = Vqgan(fixture_config());
    io::load_state_dict(*model_, weights_, "vqgan_parity.safetensors");
    model_->eval();
  }
  const torch::Tensor& at(const std::string& name) const { return fixture_.tensors.at(name); }

  io::Safetensors fixture_ = io::read_safetensors(testing::fixture_path("vqgan_parity.safetensors"));
  io::TensorMap weights_;
  Vqgan model_{nullptr};
};

TEST_F(VqganParity, ParameterNamesAndShapesAreRuDallesGumbelVQ) {
  const auto ours = io::state_dict(*model_);
  ASSERT_EQ(ours.size(), weights_.size());
  for (const auto& [name, tensor] : weights_) {
    ASSERT_TRUE(ours.count(name)) << name;
    EXPECT_EQ(ours.at(name).sizes(), tensor.sizes()) << name;
  }
  for (const char* name : {"encoder.down.0.block.0.norm1.weight", "encoder.mid.attn_1.q.weight",
                           "encoder.down.1.block.0.nin_shortcut.weight", "encoder.down.1.attn.0.proj_out.bias",
                           "encoder.down.0.downsample.conv.weight", "quantize.proj.weight",
                           "quantize.embed.weight", "quant_conv.weight", "post_quant_conv.weight",
                           "decoder.up.1.upsample.conv.weight", "decoder.up.1.attn.1.k.weight",
                           "decoder.up.0.block.1.conv2.bias", "decoder.norm_out.weight"}) {
    EXPECT_TRUE(ours.count(name)) << name;
  }
  EXPECT_FALSE(ours.count("encoder.down.0.attn.0.q.weight")) << "level 0 (side 32) does not attend";
  EXPECT_FALSE(ours.count("decoder.up.0.upsample.conv.weight")) << "the full-resolution level does not upsample";
}

TEST_F(VqganParity, EncoderLogitsAndTokensMatchRuDalle) {
  torch::NoGradGuard no_grad;
  const auto logits = model_->logits(at("images"));
  ASSERT_EQ(logits.sizes(), at("logits").sizes());
  EXPECT_LT(relative_error(logits, at("logits")), 1e-4);
  const auto tokens = model_->encode_tokens(at("images"));
  EXPECT_TRUE(torch::equal(tokens, at("tokens"))) << "get_codebook_indices with disable_gumbel_softmax";
}

TEST_F(VqganParity, DecodedImagesMatchRuDalle) {
  torch::NoGradGuard no_grad;
  const auto images = model_->decode_tokens(at("tokens"));
  ASSERT_EQ(images.sizes(), at("decoded").sizes());
  EXPECT_LT(relative_error(images, at("decoded")), 1e-4);
}

TEST_F(VqganParity, VectorQuantizerMatchesTaming) {
  VectorQuantizer quantizer(64, 32);
  io::load_state_dict(*quantizer, {{"embedding.weight", at("vq.embedding.weight")}});
  torch::NoGradGuard no_grad;
  const auto quantized = quantizer->forward(at("vq.z"));
  EXPECT_TRUE(torch::equal(quantized.tokens, at("vq.tokens")));
  EXPECT_LT(relative_error(quantized.codes, at("vq.z_q")), 1e-5);
  // taming weighs the other term by beta; the two are equal in value, so its loss is (1 + beta) MSE.
  const auto loss = quantized.codebook + 0.25 * quantized.commitment;
  EXPECT_NEAR(loss.item<double>(), at("vq.loss").item<double>(), 1e-6);
}

TEST_F(VqganParity, MisshapenOrMissingTensorsAreRefusedByName) {
  auto config = fixture_config();
  config.n_embed = 65;
  Vqgan wider(config);
  EXPECT_THROW_WITH(io::load_state_dict(*wider, weights_, "rudalle.safetensors"), Error, "rudalle.safetensors",
                    "misshapen: quantize.embed.weight [64, 32] where the model has [65, 32]");
  auto missing = weights_;
  missing.erase("decoder.up.1.upsample.conv.weight");
  EXPECT_THROW_WITH(io::load_state_dict(*model_, missing), Error, "missing: decoder.up.1.upsample.conv.weight");
  config = fixture_config();
  config.quantizer = "vector";
  Vqgan vector(config);
  EXPECT_THROW_WITH(io::load_state_dict(*vector, weights_), Error, "missing: quantize.embedding.weight",
                    "unexpected: quantize.embed.weight, quantize.proj.bias, quantize.proj.weight");
}

// The sizes make_mega_vqgan_fixture.py builds taming's VQModel with: DALL-E Mega's f16 layout
// (five levels, two blocks a level, attention at the lowest resolution only, the vector
// quantizer) at taming's smallest widths.
VqganConfig mega_fixture_config(const std::string& pixel_range, const std::string& level_attention = "taming") {
  return {.ch = 32, .ch_mult = {1, 1, 1, 2, 2}, .num_res_blocks = 2, .attn_resolutions = {4}, .z_channels = 32,
          .embed_dim = 32, .n_embed = 128, .resolution = 64, .quantizer = "vector", .pixel_range = pixel_range,
          .level_attention = level_attention};
}

class MegaVqganParity : public ::testing::Test {
 protected:
  // The fixture holds the encoder, quant_conv and codebook by taming's names; every one must
  // load, and the decoder (which no code depends on) is left as built.
  Vqgan load(const std::string& pixel_range, const std::string& level_attention = "taming") const {
    Vqgan model(mega_fixture_config(pixel_range, level_attention));
    std::unordered_set<std::string> decoder;
    for (const auto& [name, tensor] : io::state_dict(*model)) {
      if (name.rfind("decoder.", 0) == 0 || name.rfind("post_quant_conv.", 0) == 0) decoder.insert(name);
    }
    io::load_state_dict(*model, weights_, "mega_vqgan_parity.safetensors", decoder);
    model->eval();
    return model;
  }
  const torch::Tensor& at(const std::string& name) const { return fixture_.tensors.at(name); }

  io::Safetensors fixture_ = io::read_safetensors(testing::fixture_path("mega_vqgan_parity.safetensors"));
  io::TensorMap weights_ = testing::dequantized_weights(fixture_.tensors);
};

TEST_F(MegaVqganParity, TamingsNamesAtTheF16Layout) {
  auto model = load("zero_to_one");
  EXPECT_EQ(model->downsampling_factor(), 16);
  const auto ours = io::state_dict(*model);
  for (const char* name : {"encoder.down.4.attn.1.proj_out.weight", "encoder.down.3.block.0.nin_shortcut.weight",
                           "encoder.down.3.downsample.conv.weight", "encoder.mid.attn_1.q.weight",
                           "quantize.embedding.weight"}) {
    EXPECT_TRUE(ours.count(name) && weights_.count(name)) << name;
  }
  EXPECT_FALSE(ours.count("encoder.down.3.attn.0.q.weight")) << "only the lowest resolution attends";
  EXPECT_FALSE(ours.count("encoder.down.4.downsample.conv.weight")) << "the last level does not downsample";
}

TEST_F(MegaVqganParity, CodesAreTamingsEncodeOfTheImagesAsTheyAre) {
  auto model = load("zero_to_one");
  torch::NoGradGuard no_grad;
  EXPECT_LT(relative_error(model->encode_latents(at("images")), at("latents")), 1e-4);
  const auto codes = model->encode_tokens(at("images"));
  ASSERT_EQ(codes.sizes(), at("codes").sizes());
  EXPECT_TRUE(torch::equal(codes, at("codes"))) << "dalle-mini's encoding: VQModel.encode of pixels in [0, 1]";
}

TEST_F(MegaVqganParity, MinusOneToOneCodesAreTamingsEncodeOfTwiceTheImagesLessOne) {
  auto model = load("minus_one_to_one");
  torch::NoGradGuard no_grad;
  const auto codes = model->encode_tokens(at("images"));
  EXPECT_TRUE(torch::equal(codes, at("codes.minus_one_to_one")));
  EXPECT_FALSE(torch::equal(at("codes"), at("codes.minus_one_to_one"))) << "the fixture must tell the ranges apart";
}

// vqgan-jax's order before 2022-07-09 (every attention block of the lowest level after each of
// its two residual blocks), against taming's own modules called in that order.
TEST_F(MegaVqganParity, VqganJax2021OrderGivesTheOldOrdersLatentsAndCodes) {
  auto model = load("zero_to_one", "vqgan_jax_2021");
  torch::NoGradGuard no_grad;
  EXPECT_LT(relative_error(model->encode_latents(at("images")), at("latents.vqgan_jax_2021")), 1e-4);
  EXPECT_TRUE(torch::equal(model->encode_tokens(at("images")), at("codes.vqgan_jax_2021")));
  const double changed = (at("codes") != at("codes.vqgan_jax_2021")).to(torch::kFloat64).mean().item<double>();
  EXPECT_GT(changed, 0.1) << "the fixture must tell the orders apart";
}

// The order is the encoder's alone: with the same weights, the decoder draws the same images
// and a level without attention (or the mid block) is untouched.
TEST(Vqgan, LevelAttentionOrderChangesTheEncoderOnly) {
  torch::manual_seed(0);
  auto config = tiny_config("vector");
  config.num_res_blocks = 2;  // two attention blocks at the 4 x 4 level, so that the orders differ
  Vqgan taming(config);
  config.level_attention = "vqgan_jax_2021";
  Vqgan old_order(config);
  io::load_state_dict(*old_order, io::state_dict(*taming));
  taming->eval();
  old_order->eval();
  torch::NoGradGuard no_grad;
  const auto images = torch::rand({2, 3, 16, 16});
  EXPECT_GT((taming->encode_latents(images) - old_order->encode_latents(images)).abs().max().item<double>(), 1e-3);
  const auto tokens = torch::randint(0, 16, {2, 4, 4}, torch::kInt64);
  EXPECT_TRUE(torch::equal(taming->decode_tokens(tokens), old_order->decode_tokens(tokens)));
  config.attn_resolutions = {};
  Vqgan without_attention(config);
  config.level_attention = "taming";
  Vqgan without_attention_taming(config);
  io::load_state_dict(*without_attention, io::state_dict(*without_attention_taming));
  EXPECT_TRUE(
      torch::equal(without_attention->encode_latents(images), without_attention_taming->encode_latents(images)));
  config.level_attention = "vqgan_jax";
  EXPECT_THROW_WITH(Vqgan{config}, Error, "level_attention must be 'taming' or 'vqgan_jax_2021', got 'vqgan_jax'");
}

TEST(Vqgan, PixelRangeMapsImagesInAndDecodedImagesOut) {
  torch::manual_seed(0);
  auto config = tiny_config("vector");
  Vqgan taming(config);
  config.pixel_range = "zero_to_one";
  Vqgan dalle_mini(config);
  io::load_state_dict(*dalle_mini, io::state_dict(*taming));
  taming->eval();
  dalle_mini->eval();
  torch::NoGradGuard no_grad;
  const auto images = torch::rand({2, 3, 16, 16});
  EXPECT_TRUE(torch::equal(dalle_mini->encode_tokens(images), taming->vector->nearest(taming->encode_latents(images))));
  const auto tokens = taming->encode_tokens(images);
  EXPECT_TRUE(torch::equal(tokens, taming->vector->nearest(taming->encode_latents(images * 2 - 1))));
  const auto decoded = taming->decode_codes(taming->lookup(tokens));
  EXPECT_TRUE(torch::allclose(dalle_mini->decode_tokens(tokens), decoded.clamp(0, 1)));
  EXPECT_TRUE(torch::allclose(taming->decode_tokens(tokens), (decoded.clamp(-1, 1) + 1) / 2));
  config.pixel_range = "zero_to_two";
  EXPECT_THROW_WITH(Vqgan{config}, Error, "pixel_range must be 'minus_one_to_one' or 'zero_to_one', got 'zero_to_two'");
}

TEST(Vqgan, ShapesFollowTheConfig) {
  for (const char* quantizer : {"gumbel", "vector"}) {
    Vqgan model(tiny_config(quantizer));
    model->eval();
    EXPECT_EQ(model->downsampling_factor(), 4);
    EXPECT_EQ(model->vocab_size(), 16);
    torch::NoGradGuard no_grad;
    const auto tokens = model->encode_tokens(torch::rand({2, 3, 16, 24}));
    EXPECT_EQ(tokens.sizes(), (std::vector<int64_t>{2, 4, 6})) << quantizer;
    EXPECT_EQ(tokens.scalar_type(), torch::kInt64);
    EXPECT_GE(tokens.min().item<int64_t>(), 0);
    EXPECT_LT(tokens.max().item<int64_t>(), 16);
    const auto images = model->decode_tokens(tokens);
    EXPECT_EQ(images.sizes(), (std::vector<int64_t>{2, 3, 16, 24}));
    EXPECT_GE(images.min().item<float>(), 0.0f);
    EXPECT_LE(images.max().item<float>(), 1.0f);
    EXPECT_THROW_WITH(model->encode_tokens(torch::rand({1, 3, 18, 16})), Error, "multiples of 4", "18x16");
    EXPECT_THROW_WITH(model->encode_tokens(torch::rand({1, 1, 16, 16})), Error, "[batch, 3, H, W]");
    EXPECT_THROW_WITH(model->decode_tokens(torch::full({1, 2, 2}, 16, torch::kInt64)), Error, "[0, 16)");
    EXPECT_THROW_WITH(model->decode_tokens(torch::zeros({1, 4})), Error, "[batch, h, w] int64");
  }
}

TEST(Vqgan, InconsistentSizesAreRefused) {
  auto config = tiny_config();
  config.norm_groups = 32;
  EXPECT_THROW_WITH(Vqgan{config}, Error, "ch * ch_mult (8) must be a multiple of norm_groups (32)");
  config = tiny_config();
  config.attn_resolutions = {5};
  EXPECT_THROW_WITH(Vqgan{config}, Error, "attn_resolutions entry 5 is no level's side (levels are 16, 8, 4)");
  config = tiny_config();
  config.resolution = 18;
  EXPECT_THROW_WITH(Vqgan{config}, Error, "resolution (18) must be a multiple of 2^(levels - 1) = 4");
  config = tiny_config();
  config.ch_mult = {};
  EXPECT_THROW_WITH(Vqgan{config}, Error, "ch_mult needs at least one level");
}

TEST(Vqgan, StraightThroughGradientReachesTheEncoder) {
  for (const char* quantizer : {"gumbel", "vector"}) {
    torch::manual_seed(0);
    Vqgan model(tiny_config(quantizer));
    const auto x = torch::rand({2, 3, 16, 16}) * 2 - 1;
    // Only the reconstruction: the quantizer's own loss terms would reach the encoder anyway.
    const auto out = model->forward(x, 0.5);
    (out.reconstruction - x).abs().mean().backward();
    for (const char* name : {"encoder.conv_in.weight", "quant_conv.weight", "decoder.conv_in.weight"}) {
      const auto grad = model->named_parameters()[name].grad();
      ASSERT_TRUE(grad.defined()) << quantizer << " " << name;
      EXPECT_GT(grad.abs().sum().item<double>(), 0.0) << quantizer << " " << name;
    }
  }
}

TEST(GumbelQuantizer, TrainingSampleIsAOneHotCodeWithTheRelaxedGradient) {
  torch::manual_seed(0);
  GumbelQuantizer quantizer(4, 8, 3);
  const auto z = torch::randn({2, 4, 3, 3}, torch::requires_grad());
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto out = quantizer->forward(z, 1.0, generator);
  EXPECT_EQ(out.tokens.sizes(), (std::vector<int64_t>{2, 3, 3}));
  // The forward value is exactly the chosen code vector.
  EXPECT_LT(relative_error(out.codes, quantizer->lookup(out.tokens)), 1e-6);
  EXPECT_GE(out.kl.item<double>(), 0.0);
  EXPECT_LE(out.kl.item<double>(), std::log(8.0) + 1e-6);
  out.codes.sum().backward();
  EXPECT_GT(z.grad().abs().sum().item<double>(), 0.0) << "the relaxed sample carries the gradient to z";
  // Very peaked logits: the sample is the argmax whatever the noise.
  torch::NoGradGuard no_grad;
  const auto peaked = quantizer->forward(z * 1000, 1.0, generator);
  EXPECT_TRUE(torch::equal(peaked.tokens, quantizer->logits(z * 1000).argmax(1)));
}

TEST(VectorQuantizer, CodebookAndCommitmentLossesOnAHandMadeCase) {
  VectorQuantizer quantizer(2, 2);
  {
    torch::NoGradGuard no_grad;
    quantizer->embedding->weight.copy_(torch::tensor({{0.0f, 0.0f}, {1.0f, 1.0f}}));
  }
  // One position, z = (0.2, 0.1): code 0 is nearest, squared error (0.04 + 0.01) / 2 values.
  const auto z = torch::tensor({0.2f, 0.1f}).reshape({1, 2, 1, 1}).requires_grad_();
  const auto out = quantizer->forward(z);
  EXPECT_EQ(out.tokens.item<int64_t>(), 0);
  EXPECT_NEAR(out.codebook.item<double>(), 0.025, 1e-7);
  EXPECT_NEAR(out.commitment.item<double>(), 0.025, 1e-7);
  // Straight-through: the forward value is the code, the gradient passes to z unchanged.
  EXPECT_TRUE(torch::allclose(out.codes.flatten(), torch::zeros({2})));
  // The codebook term moves only the code, the commitment term only z: d/de = (e - z), d/dz = (z - e).
  out.codebook.backward({}, /*retain_graph=*/true);
  EXPECT_TRUE(torch::allclose(quantizer->embedding->weight.grad(), torch::tensor({{-0.2f, -0.1f}, {0.0f, 0.0f}})));
  EXPECT_FALSE(z.grad().defined() && z.grad().abs().sum().item<double>() > 0);
  quantizer->embedding->weight.mutable_grad().zero_();
  (out.commitment + out.codes.sum()).backward();
  EXPECT_TRUE(torch::allclose(z.grad().flatten(), torch::tensor({0.2f + 1.0f, 0.1f + 1.0f})));
  EXPECT_EQ(quantizer->embedding->weight.grad().abs().sum().item<double>(), 0.0);
}

TEST(VectorQuantizer, RestartReplacesOnlyUnusedCodesWithEncoderOutputs) {
  torch::manual_seed(0);
  VectorQuantizer quantizer(4, 3);
  const auto before = quantizer->embedding->weight.detach().clone();
  const auto z = torch::randn({2, 3, 2, 2});
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1);
  const auto restarted = quantizer->restart_unused(torch::tensor({3, 0, 1, 0}), z, generator);
  EXPECT_TRUE(torch::equal(restarted, torch::tensor({1, 3}, torch::kInt64)));
  const auto after = quantizer->embedding->weight.detach();
  EXPECT_TRUE(torch::equal(after[0], before[0]));
  EXPECT_TRUE(torch::equal(after[2], before[2]));
  const auto rows = z.permute({0, 2, 3, 1}).reshape({-1, 3});
  for (int64_t code : {1, 3}) {
    EXPECT_FALSE(torch::equal(after[code], before[code])) << code;
    EXPECT_TRUE(((rows - after[code]).abs().sum(1) == 0).any().item<bool>()) << code << " is one of z's vectors";
  }
  EXPECT_EQ(quantizer->restart_unused(torch::tensor({1, 1, 1, 1}), z, generator).numel(), 0);
}

}  // namespace
}  // namespace dalle::models
