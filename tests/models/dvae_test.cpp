#include "dalle/models/dvae.h"

#include <torch/torch.h>

#include "dalle/data/image.h"
#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"
#include "test_support.h"

namespace dalle::models {
namespace {

TEST(DvaePixels, MappingMatchesOpenAisAndInverts) {
  const auto x = torch::tensor({0.0, 0.5, 1.0});
  EXPECT_TRUE(torch::allclose(map_pixels(x), torch::tensor({0.1, 0.5, 0.9})));
  EXPECT_TRUE(torch::allclose(unmap_pixels(map_pixels(x)), x));
  EXPECT_TRUE(torch::allclose(unmap_pixels(torch::tensor({0.0, 1.0})), torch::tensor({0.0, 1.0})));
}


using testing::relative_error;
using io::with_prefix_removed;

DvaeConfig tiny_config() {
  return {.hidden = 16, .decoder_init = 8, .vocab_size = 64};
}

class DvaeParity : public ::testing::Test {
 protected:
  io::Safetensors fixture_ =
      io::read_safetensors(std::string(DALLE_SOURCE_DIR) + "/tests/fixtures/dvae_parity.safetensors");
};

TEST_F(DvaeParity, EncoderLogitsMatchOpenAIsPackage) {
  DvaeEncoder encoder(tiny_config());
  io::load_state_dict(*encoder, with_prefix_removed(fixture_.tensors, "encoder."));
  torch::NoGradGuard no_grad;
  const auto logits = encoder->forward(map_pixels(fixture_.tensors.at("pixels")));
  EXPECT_EQ(logits.sizes(), fixture_.tensors.at("logits").sizes());
  EXPECT_LT(relative_error(logits, fixture_.tensors.at("logits")), 1e-4);
}

TEST_F(DvaeParity, DecoderOutputMatchesOpenAIsPackage) {
  DvaeDecoder decoder(tiny_config());
  io::load_state_dict(*decoder, with_prefix_removed(fixture_.tensors, "decoder."));
  torch::NoGradGuard no_grad;
  const auto output = decoder->forward(fixture_.tensors.at("codes"));
  EXPECT_EQ(output.sizes(), fixture_.tensors.at("output").sizes());
  EXPECT_LT(relative_error(output, fixture_.tensors.at("output")), 1e-4);
}

TEST_F(DvaeParity, ParameterNamesAreTheReleasedOnes) {
  const auto names = io::state_dict(*Dvae(tiny_config()));
  for (const char* name : {"encoder.blocks.input.w", "encoder.blocks.group_1.block_1.res_path.conv_1.w",
                           "encoder.blocks.group_2.block_1.id_path.b", "encoder.blocks.output.conv.w",
                           "decoder.blocks.input.w", "decoder.blocks.group_4.block_2.res_path.conv_4.b",
                           "decoder.blocks.output.conv.b"}) {
    EXPECT_TRUE(names.count(name)) << name;
  }
  EXPECT_FALSE(names.count("encoder.blocks.group_1.block_1.id_path.w")) << "equal widths use the identity";
}

TEST(Dvae, ShapesFollowTheConfig) {
  Dvae dvae(tiny_config());
  torch::NoGradGuard no_grad;
  const auto tokens = dvae->encode_tokens(torch::rand({2, 3, 64, 64}));
  EXPECT_EQ(tokens.sizes(), (std::vector<int64_t>{2, 8, 8}));
  EXPECT_EQ(tokens.scalar_type(), torch::kInt64);
  EXPECT_LT(tokens.max().item<int64_t>(), 64);
  const auto images = dvae->decode_tokens(tokens);
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{2, 3, 64, 64}));
  EXPECT_GE(images.min().item<float>(), 0.0f);
  EXPECT_LE(images.max().item<float>(), 1.0f);

  auto config = tiny_config();
  config.downsamplings = 2;
  EXPECT_EQ(Dvae(config)->encode_tokens(torch::rand({1, 3, 16, 16})).sizes(), (std::vector<int64_t>{1, 4, 4}));
  config.downsamplings = 4;
  EXPECT_THROW_WITH(Dvae{config}, Error, "at most groups - 1");
  EXPECT_THROW_WITH(dvae->encoder->forward(torch::rand({1, 3, 60, 60})), Error, "multiples of 8");
}

TEST(StateDict, RefusesMissingUnexpectedAndMisshapenTensorsByName) {
  DvaeEncoder encoder(tiny_config());
  auto weights = io::state_dict(*encoder);
  for (auto& [name, tensor] : weights) tensor = tensor.clone().normal_();
  const auto before = encoder->named_parameters()["blocks.input.w"].clone();

  auto missing = weights;
  missing.erase("blocks.input.w");
  EXPECT_THROW_WITH(io::load_state_dict(*encoder, missing, "enc.safetensors"), Error, "enc.safetensors",
                    "missing: blocks.input.w");
  auto extra = weights;
  extra["blocks.group_9.block_1.res_path.conv_1.w"] = torch::zeros({1});
  EXPECT_THROW_WITH(io::load_state_dict(*encoder, extra), Error, "unexpected: blocks.group_9");
  auto misshapen = weights;
  misshapen["blocks.output.conv.b"] = torch::zeros({65});
  EXPECT_THROW_WITH(io::load_state_dict(*encoder, misshapen), Error, "misshapen: blocks.output.conv.b [65]",
                    "the model has [64]");

  // A refused load changes nothing; an accepted one copies every tensor.
  EXPECT_TRUE(torch::equal(encoder->named_parameters()["blocks.input.w"], before));
  weights["blocks.input.w"].fill_(0.5);
  io::load_state_dict(*encoder, weights);
  EXPECT_TRUE(torch::equal(encoder->named_parameters()["blocks.input.w"], weights["blocks.input.w"]));
}

}  // namespace
}  // namespace dalle::models
