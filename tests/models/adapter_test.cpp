#include "dalle/models/adapter.h"

#include <torch/torch.h>

#include <filesystem>

#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/bart_prior.h"
#include "dalle/models/prior.h"
#include "test_support.h"

namespace dalle::models {
namespace {

using testing::relative_error;
using torch::indexing::Slice;

PriorConfig tiny_prior() {
  return {.text_length = 6, .text_vocab_size = 20, .grid_size = 4, .image_vocab_size = 12, .layers = 4, .width = 32,
          .heads = 4, .conv_kernel = 3};
}

torch::Tensor prior_tokens(const PriorConfig& config) {
  auto text = torch::randint(4, config.text_vocab_size, {2, config.text_length});
  text.index_put_({Slice(), 0}, 2);
  return torch::cat({text, torch::randint(0, config.image_vocab_size, {2, config.image_length()})}, 1);
}

// Moves every adapter's B off zero, as training would.
void train_adapters_at_random(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    if (item.key().ends_with(".lora_B.weight")) item.value().normal_(0.0, 0.05);
  }
}

const AdapterConfig kAttentionAndMlp{.rank = 4, .alpha = 8, .targets = {"resblocks.*.qkv", "resblocks.*.fc_*"}};

TEST(Adapter, TargetsTheNamedLayersUnderPeftsNamesAndStartsAsTheBase) {
  torch::manual_seed(0);
  Prior prior(tiny_prior());
  prior->eval();
  const auto tokens = prior_tokens(tiny_prior());
  const auto before = prior->forward(tokens);
  const auto adapted = add_adapters(*prior, kAttentionAndMlp);
  // Each of the tiny prior's 4 layers is an attention resblock (qkv) then an MLP one (fc_in, fc_out).
  EXPECT_EQ(adapted.size(), 12u);
  const auto weights = io::state_dict(*prior);
  EXPECT_EQ(weights.at("resblocks.0.qkv.lora_A.weight").sizes(), (torch::IntArrayRef{4, 32}));
  EXPECT_EQ(weights.at("resblocks.0.qkv.lora_B.weight").sizes(), (torch::IntArrayRef{96, 4}));
  EXPECT_EQ(adapter_tensors(weights).size(), 24u);
  EXPECT_EQ(weights.count("resblocks.0.out.lora_A.weight"), 0u) << "out is not a target";
  EXPECT_TRUE(torch::equal(prior->forward(tokens), before)) << "B starts at zero";
}

TEST(Adapter, MergedEqualsBasePlusAdapter) {
  torch::manual_seed(1);
  Prior prior(tiny_prior());
  prior->eval();
  add_adapters(*prior, kAttentionAndMlp);
  train_adapters_at_random(*prior);
  const auto tokens = prior_tokens(tiny_prior());
  const auto adapted = prior->forward(tokens);
  io::TensorMap tensors;  // copies: merging below writes into the model's own weights
  for (const auto& [name, tensor] : io::state_dict(*prior)) tensors.emplace(name, tensor.detach().clone());
  // The adapters change the output: the comparison below is not between two copies of the base.
  Prior base(tiny_prior());
  base->eval();
  io::load_state_dict(*base, without_adapter_tensors(tensors));
  ASSERT_GT(relative_error(base->forward(tokens), adapted), 1e-3);

  // Merged in the model, and merged as tensors into a second model.
  merge_adapters(*prior);
  EXPECT_TRUE(adapter_tensors(io::state_dict(*prior)).empty());
  EXPECT_LT(relative_error(prior->forward(tokens), adapted), 1e-5);
  Prior merged(tiny_prior());
  merged->eval();
  io::load_state_dict(*merged, merge_adapter_tensors(tensors, adapter_tensors(tensors), kAttentionAndMlp.scale()));
  EXPECT_LT(relative_error(merged->forward(tokens), adapted), 1e-5);
}

TEST(Adapter, AFileLoadsOntoItsBaseWithAWeight) {
  torch::manual_seed(2);
  const auto path = (std::filesystem::path(::testing::TempDir()) / "adapter.safetensors").string();
  Prior prior(tiny_prior());
  prior->eval();
  const auto base_weights = io::state_dict(*prior);
  add_adapters(*prior, kAttentionAndMlp);
  train_adapters_at_random(*prior);
  save_adapter_file(path, io::state_dict(*prior), kAttentionAndMlp, "runs/base/checkpoints/step-1", "prior");
  const auto file = load_adapter_file(path);
  EXPECT_EQ(file.rank, 4);
  EXPECT_DOUBLE_EQ(file.scale(), 2.0);
  EXPECT_EQ(file.base, "runs/base/checkpoints/step-1");
  EXPECT_EQ(file.family, "prior");
  EXPECT_EQ(file.tensors.size(), 24u) << "the adapter alone, not the base";

  // Weight 0.5 is the adapter with B halved.
  {
    torch::NoGradGuard no_grad;
    for (auto& item : prior->named_parameters()) {
      if (item.key().ends_with(".lora_B.weight")) item.value().mul_(0.5);
    }
  }
  const auto tokens = prior_tokens(tiny_prior());
  const auto expected = prior->forward(tokens);
  Prior loaded(tiny_prior());
  loaded->eval();
  io::load_state_dict(*loaded, base_weights);
  apply_adapter(*loaded, file, 0.5);
  EXPECT_LT(relative_error(loaded->forward(tokens), expected), 1e-5);
}

TEST(Adapter, WorksOnTheBartPriorsProjections) {
  torch::manual_seed(3);
  const BartPriorConfig config{.layers = 2, .heads = 4, .width = 32, .glu_width = 44, .text_vocab_size = 49,
                               .image_vocab_size = 19, .codes = 16};
  BartEncoder encoder(config);
  encoder->eval();
  const AdapterConfig attention{.rank = 2, .alpha = 2, .targets = {"layers.*.self_attn.*_proj"}};
  const auto text = torch::randint(0, config.text_vocab_size, {2, config.text_length});
  const auto base = encoder->forward(text);
  EXPECT_EQ(add_adapters(*encoder, attention).size(), 8u);  // q, k, v, out in 2 layers
  train_adapters_at_random(*encoder);
  const auto adapted = encoder->forward(text);
  ASSERT_GT(relative_error(adapted, base), 1e-3) << "the adapters change the encoder";
  merge_adapters(*encoder);
  EXPECT_LT(relative_error(encoder->forward(text), adapted), 1e-5);
}

TEST(Adapter, RefusesWhatDoesNotFit) {
  Prior prior(tiny_prior());
  EXPECT_THROW_WITH((add_adapters(*prior, {.rank = 4, .targets = {"resblocks.*.attention"}})), Error, "\"resblocks.*.attention\" matches no linear layer");
  EXPECT_THROW_WITH((add_adapters(*prior, {.rank = 64, .targets = {"resblocks.0.qkv"}})), Error, "does not fit");
  const auto path = (std::filesystem::path(::testing::TempDir()) / "not_adapter.safetensors").string();
  io::write_safetensors(path, {{"resblocks.0.qkv.weight", torch::zeros({96, 32})}});
  EXPECT_THROW_WITH((load_adapter_file(path)), Error, "not an adapter file");
  const io::TensorMap lone{{"resblocks.9.qkv.lora_A.weight", torch::zeros({4, 32})},
                           {"resblocks.9.qkv.lora_B.weight", torch::zeros({96, 4})}};
  EXPECT_THROW_WITH((merge_adapter_tensors(io::state_dict(*prior), lone, 1.0)), Error, "no linear layer resblocks.9.qkv");
  EXPECT_THROW_WITH((merge_adapter_tensors(io::state_dict(*prior), {{"x.lora_A.weight", torch::zeros({4, 32})}}, 1.0)), Error, "only one of lora_A and lora_B");
}

TEST(Adapter, ParsesFileAndWeight) {
  EXPECT_EQ(parse_weighted_adapter("style.safetensors").path, "style.safetensors");
  EXPECT_DOUBLE_EQ(parse_weighted_adapter("style.safetensors").weight, 1.0);
  const auto weighted = parse_weighted_adapter("a:b/style.safetensors:0.75");
  EXPECT_EQ(weighted.path, "a:b/style.safetensors");
  EXPECT_DOUBLE_EQ(weighted.weight, 0.75);
  EXPECT_EQ(parse_weighted_adapter("c:/style").path, "c:/style") << "not a number after the colon: part of the path";
  EXPECT_THROW_WITH((parse_weighted_adapter("x:inf")), Error, "finite");
}

}  // namespace
}  // namespace dalle::models
