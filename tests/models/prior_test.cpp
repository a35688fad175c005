#include "dalle/models/prior.h"
#include "dalle/models/rudalle_import.h"

#include <torch/torch.h>

#include <map>
#include <string>

#include "dalle/io/checkpoint.h"
#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/adapter.h"
#include "dalle/models/trained.h"
#include "dalle/text/tokenizer.h"
#include "test_support.h"

namespace dalle::models {
namespace {

using testing::relative_error;
using torch::indexing::Slice;

// The sizes of tests/fixtures/rudalle_prior_parity.safetensors (docs/rudalle-prior.md).
PriorConfig rudalle_fixture_config() {
  return {.text_length = 8, .text_vocab_size = 32, .grid_size = 4, .image_vocab_size = 16, .layers = 4, .width = 64,
          .heads = 4, .layer_pattern = "rudalle", .sandwich_norm = true, .head_norm = true, .gelu = "tanh"};
}

PriorConfig tiny_config() {
  return {.text_length = 6, .text_vocab_size = 20, .grid_size = 5, .image_vocab_size = 12, .layers = 5, .width = 32,
          .heads = 4, .conv_kernel = 3};
}

torch::Tensor random_tokens(const PriorConfig& config, int64_t batch) {
  auto text = torch::randint(4, config.text_vocab_size, {batch, config.text_length});
  text.index_put_({Slice(), 0}, 2);
  text.index_put_({Slice(), Slice(config.text_length - 2)}, 0);  // padding
  return torch::cat({text, torch::randint(0, config.image_vocab_size, {batch, config.image_length()})}, 1);
}

// A prior built with ResblockBuilt hands each block to the caller as soon as its values are
// drawn, in order, and draws what a plain build from the same seed draws, bit for bit: a
// caller that empties each block (as sharding cuts it) leaves no resblock holding values.
TEST(PriorBuild, BlockByBlockDrawsThePlainBuildsWeights) {
  const auto config = tiny_config();
  torch::manual_seed(11);
  const Prior plain(config);
  std::map<std::string, torch::Tensor> handed;
  std::vector<size_t> order;
  torch::manual_seed(11);
  const Prior built(config, [&](size_t b, ResblockImpl& block) {
    order.push_back(b);
    for (auto& item : block.named_parameters()) {
      ASSERT_GT(item.value().numel(), 0) << "block " << b << " is handed with its values";
      handed.emplace("resblocks." + std::to_string(b) + "." + item.key(), item.value().detach().clone());
      item.value().set_data(torch::empty({0}));
    }
  });
  ASSERT_EQ(order.size(), plain->resblocks().size());
  for (size_t b = 0; b < order.size(); ++b) EXPECT_EQ(order[b], b);
  const auto built_parameters = built->named_parameters();
  size_t in_blocks = 0;
  for (const auto& item : plain->named_parameters()) {
    if (item.key().starts_with("resblocks.")) {
      ++in_blocks;
      EXPECT_EQ(built_parameters[item.key()].numel(), 0) << item.key() << " was emptied by the caller";
      ASSERT_TRUE(handed.count(item.key())) << item.key();
      EXPECT_TRUE(torch::equal(handed.at(item.key()), item.value())) << item.key();
    } else {
      EXPECT_TRUE(torch::equal(built_parameters[item.key()], item.value())) << item.key();
    }
  }
  EXPECT_EQ(handed.size(), in_blocks);
  torch::manual_seed(12);
  const Prior other(config);
  size_t differ = 0;
  for (const auto& item : other->named_parameters()) {
    if (handed.count(item.key()) && !torch::equal(handed.at(item.key()), item.value())) ++differ;
  }
  EXPECT_GT(differ, 0u) << "another seed draws other weights";
}

// A prior built from a mapped checkpoint holds its weights once: each block's file pages are
// released once the block is filled (the 25 MB file stays mapped but leaves memory), and the
// values are the checkpoint's.
TEST(PriorBuild, FromAMappedCheckpointReleasesEachBlocksPages) {
  testing::ScratchDir dir;
  const PriorConfig config{.text_length = 6, .text_vocab_size = 20, .grid_size = 4, .image_vocab_size = 12,
                           .layers = 2, .width = 512, .heads = 8, .conv_kernel = 3};
  const Prior saved(config);
  const auto values = io::state_dict(*saved);
  io::save_checkpoint(dir / "ckpt",
                      {"model: {text_length: 6, text_vocab_size: 20, grid_size: 4, image_vocab_size: 12, layers: 2, "
                       "width: 512, heads: 8, conv_kernel: 3}\n",
                       values, {}, {}});
  build_trained_prior(config, read_trained_prior_weights(dir / "ckpt"));  // the code's own pages read once
  const auto weights = read_trained_prior_weights(dir / "ckpt");
  const int64_t before = testing::resident_file_kb();
  const auto built = build_trained_prior(config, weights);
  const int64_t grown = testing::resident_file_kb() - before;
  EXPECT_LT(grown, 8 * 1024) << "of the 25 MB read, " << grown << " kB stayed resident";
  for (const auto& [name, tensor] : io::state_dict(*built)) EXPECT_TRUE(torch::equal(tensor, values.at(name))) << name;
}

// A run's adapters are folded into each block as it is read, never into a whole copy of the
// model first: the weights read keep the matrices as the file stores them and the adapters
// apart; a block read holds its matrices folded; the prior built equals the adapters merged as
// tensors, bit for bit. An adapter of a layer the model lacks, or adapters without a rank in the
// config, are refused.
TEST(PriorBuild, ARunsAdaptersAreFoldedIntoEachBlockAsItIsRead) {
  testing::ScratchDir dir;
  torch::manual_seed(3);
  const auto config = tiny_config();
  const AdapterConfig adapter{.rank = 4, .alpha = 8, .targets = {"resblocks.*.qkv", "resblocks.*.fc_*"}};
  Prior trained(config);
  add_adapters(*trained, adapter);
  io::TensorMap values;
  {
    torch::NoGradGuard no_grad;
    for (const auto& [name, tensor] : io::state_dict(*trained)) {
      values.emplace(name, name.ends_with(".lora_B.weight") ? torch::randn_like(tensor) * 0.05 : tensor.clone());
    }
  }
  const std::string yaml =
      "model: {text_length: 6, text_vocab_size: 20, grid_size: 5, image_vocab_size: 12, layers: 5, width: 32, "
      "heads: 4, conv_kernel: 3}\nadapter: {rank: 4, alpha: 8, targets: [resblocks.*.qkv, resblocks.*.fc_*]}\n";
  io::save_checkpoint(dir / "run", {yaml, values, {}, {}});
  const auto merged = merge_adapter_tensors(values, adapter_tensors(values), adapter.scale());

  const auto weights = read_trained_prior_weights(dir / "run");
  EXPECT_EQ(weights.adapters.size(), adapter_tensors(values).size());
  EXPECT_TRUE(adapter_tensors(weights.weights).empty());
  const std::string matrix = "resblocks.1.fc_in.weight";
  EXPECT_TRUE(torch::equal(weights.weights.at(matrix), values.at(matrix))) << "kept as stored until read";
  ASSERT_FALSE(torch::equal(merged.at(matrix), values.at(matrix))) << "the adapters change the matrices";
  const auto block = weights.read([](const std::string& name) { return name.starts_with("resblocks.1."); });
  EXPECT_TRUE(adapter_tensors(block).empty());
  EXPECT_TRUE(torch::equal(block.at(matrix), merged.at(matrix))) << "folded as read";
  const auto built = io::state_dict(*build_trained_prior(config, weights));
  ASSERT_EQ(built.size(), merged.size());
  for (const auto& [name, tensor] : built) EXPECT_TRUE(torch::equal(tensor, merged.at(name))) << name;

  auto stray = values;
  stray.emplace("resblocks.12.qkv.lora_A.weight", torch::zeros({4, 32}));
  stray.emplace("resblocks.12.qkv.lora_B.weight", torch::zeros({96, 4}));
  io::save_checkpoint(dir / "stray", {yaml, stray, {}, {}});
  EXPECT_THROW_WITH(read_trained_prior_weights(dir / "stray"), Error, "no linear layer resblocks.12.qkv.weight");
  // Adapters whose scale the config does not give are refused, not folded at a guess.
  io::save_checkpoint(dir / "unscaled", {yaml.substr(0, yaml.find("adapter:")), values, {}, {}});
  EXPECT_THROW_WITH(read_trained_prior_weights(dir / "unscaled"), Error, "holds adapters, but its config has no "
                    "adapter.rank");
}

class RudalleParity : public ::testing::Test {
 protected:
  void SetUp() override {
    io::load_state_dict(*prior_, import_rudalle_state(io::with_prefix_removed(fixture_.tensors, "state."),
                                                      rudalle_fixture_config()));
    prior_->eval();
  }
  io::Safetensors fixture_ = io::read_safetensors(testing::fixture_path("rudalle_prior_parity.safetensors"));
  Prior prior_{rudalle_fixture_config()};
  const torch::Tensor& at(const std::string& name) const { return fixture_.tensors.at(name); }
};

TEST_F(RudalleParity, LogitsMatchOnBothAttentionPaths) {
  torch::NoGradGuard no_grad;
  for (const char* path : {"sparse", "dense"}) {
    auto config = rudalle_fixture_config();
    config.attention_path = path;
    Prior prior(config);
    io::load_state_dict(*prior, io::state_dict(*prior_));
    const auto logits = prior->forward(at("input.ids"));
    EXPECT_EQ(logits.sizes(), at("output.logits").sizes());
    EXPECT_LT(relative_error(logits, at("output.logits")), 1e-4) << path;
  }
}

TEST_F(RudalleParity, ACheckpointUnderItsOwnNamesLoadsAsImported) {
  // The layout scripts/export_rudalle_prior.py writes: the sizes, ruDALL-E's names.
  testing::ScratchDir dir;
  const std::string sizes = "kind: prior\nmodel:\n  text_length: 8\n  text_vocab_size: 32\n  grid_size: 4\n"
                            "  image_vocab_size: 16\n  layers: 4\n  width: 64\n  heads: 4\n  sandwich_norm: true\n"
                            "  head_norm: true\n  gelu: tanh\n";
  const auto theirs = io::with_prefix_removed(fixture_.tensors, "state.");
  io::save_checkpoint(dir / "rudalle", {.config_yaml = sizes + "  layer_pattern: rudalle\n", .weights = theirs});
  auto trained = load_trained_prior(dir / "rudalle");
  torch::NoGradGuard no_grad;
  EXPECT_LT(relative_error(trained.model->forward(at("input.ids")), at("output.logits")), 1e-4);
  io::save_checkpoint(dir / "dalle-rule", {.config_yaml = sizes, .weights = theirs});
  EXPECT_THROW_WITH(load_trained_prior(dir / "dalle-rule"), Error, "layer_pattern: rudalle");
}

TEST_F(RudalleParity, LayerMasksAreRudalles) {
  for (int64_t layer = 0; layer < 4; ++layer) {
    const auto& block = dynamic_cast<AttentionResblockImpl&>(*prior_->resblocks()[2 * layer]);
    EXPECT_TRUE(torch::equal(block.mask().dense(), at("mask.layer_" + std::to_string(layer)).to(torch::kBool)))
        << layer;
  }
}

TEST_F(RudalleParity, CachedStepsMatchItsCachedLogits) {
  torch::NoGradGuard no_grad;
  const auto ids = at("input.ids");
  const int64_t prefix = at("cache.prefix_len").item<int64_t>();
  auto cache = prior_->make_cache(ids.size(0));
  const auto prefix_logits = prior_->forward_cached(ids.index({Slice(), Slice(0, prefix)}), cache);
  EXPECT_LT(relative_error(prefix_logits, at("cache.prefix_logits")), 1e-4);
  std::vector<torch::Tensor> steps;
  const auto ends = at("cache.step_ends");
  for (int64_t i = 0; i < ends.size(0); ++i) {
    steps.push_back(prior_->forward_cached(ids.index({Slice(), Slice(cache.length, ends[i].item<int64_t>())}), cache));
  }
  EXPECT_LT(relative_error(torch::cat(steps, 1), at("cache.step_logits")), 1e-4);
  EXPECT_EQ(cache.length, ids.size(1));
}

TEST(RudalleImport, RefusesUnknownTensors) {
  io::TensorMap state{{"transformer.layers.0.attention.rotary.weight", torch::zeros({1})}};
  EXPECT_THROW_WITH(import_rudalle_state(state, rudalle_fixture_config()), Error,
                    "transformer.layers.0.attention.rotary.weight");
}

TEST(RudalleImport, RefusesTheDallePattern) {
  auto config = rudalle_fixture_config();
  config.layer_pattern = "dalle";
  EXPECT_THROW_WITH(import_rudalle_state({}, config), Error, "layer_pattern: rudalle");
  config.attention = {"row", "column", "row", "conv"};
  EXPECT_NO_THROW(import_rudalle_state({}, config)) << "a pattern named layer by layer is taken as it is";
}

TEST(Prior, CachedAndUncachedForwardAgree) {
  torch::manual_seed(1);
  torch::NoGradGuard no_grad;
  Prior prior(tiny_config());
  prior->eval();
  const auto tokens = random_tokens(tiny_config(), 3);
  const auto full = prior->forward(tokens);
  auto cache = prior->make_cache(3);
  std::vector<torch::Tensor> steps{prior->forward_cached(tokens.index({Slice(), Slice(0, 6)}), cache)};
  while (cache.length < tokens.size(1)) {
    steps.push_back(prior->forward_cached(tokens.index({Slice(), Slice(cache.length, cache.length + 1)}), cache));
  }
  EXPECT_LT(relative_error(torch::cat(steps, 1), full), 1e-5);
}

TEST(Prior, ResblocksAreListedAndCanBeWrapped) {
  Prior prior(tiny_config());
  ASSERT_EQ(prior->resblocks().size(), 10u);
  const auto names = io::state_dict(*prior);
  EXPECT_TRUE(names.contains("resblocks.0.qkv.weight"));
  EXPECT_TRUE(names.contains("resblocks.9.fc_out.bias"));
  EXPECT_FALSE(names.contains("resblocks.0.output_norm.weight"));  // no sandwich norm by default

  const auto tokens = random_tokens(tiny_config(), 2);
  prior->eval();
  const auto plain = prior->forward(tokens);
  int calls = 0;
  prior->set_resblock_runner([&](ResblockImpl& block, const torch::Tensor& x, const ResblockContext& context) {
    ++calls;
    return x + block.branch(x, context);
  });
  EXPECT_TRUE(torch::allclose(prior->forward(tokens), plain));
  EXPECT_EQ(calls, 10);
}

// The ends, as ShardedPrior cuts and gathers them from outside: their parameters listed once
// each, by state-dict name, the embeddings' before the resblocks and the head's after; an
// end runner sees every forward's embeddings and head, cached decoding and its steps too.
TEST(Prior, EndsAreListedAndCanBeWrapped) {
  Prior prior(tiny_config());
  std::vector<std::string> outside;
  for (const auto& item : prior->named_parameters()) {
    if (!item.key().starts_with("resblocks.")) outside.push_back(item.key());
  }
  std::vector<std::string> ends;
  for (const auto end : {PriorEnd::embeddings, PriorEnd::head}) {
    for (const auto& [name, parameter] : prior->end_parameters(end)) {
      EXPECT_TRUE(parameter.is_same(prior->named_parameters()[name])) << name;
      ends.push_back(name);
    }
  }
  EXPECT_EQ(ends, outside);
  EXPECT_EQ(prior->end_parameters(PriorEnd::embeddings).front().first, "text_embedding.weight");
  EXPECT_EQ(prior->end_parameters(PriorEnd::head).back().first, "to_logits.bias");

  torch::NoGradGuard no_grad;
  prior->eval();
  const auto tokens = random_tokens(tiny_config(), 2);
  const auto plain = prior->forward(tokens);
  std::map<PriorEnd, int> calls;
  prior->set_end_runner([&](PriorEnd end, const std::function<torch::Tensor(const torch::Tensor&)>& part,
                            const torch::Tensor& input) {
    ++calls[end];
    return part(input);
  });
  EXPECT_TRUE(torch::equal(prior->forward(tokens), plain));
  auto cache = prior->make_cache(2);
  prior->forward_cached(tokens.index({Slice(), Slice(0, tiny_config().text_length)}), cache);
  const auto position = torch::full({1}, cache.length, torch::kInt64);
  prior->forward_step(tokens.index({Slice(), Slice(cache.length, cache.length + 1)}), cache, position,
                      cache.length + 1);
  EXPECT_EQ(calls[PriorEnd::embeddings], 3);
  EXPECT_EQ(calls[PriorEnd::head], 3);
}

TEST(Prior, LossWeighsTextAndImageByTheirOwnCounts) {
  const auto config = tiny_config();
  const auto tokens = random_tokens(config, 2);
  const int64_t classes = config.text_classes() + config.image_vocab_size;
  // Uniform logits: each part is log(its own number of classes).
  const auto uniform = prior_loss(torch::zeros({2, config.length(), classes}), tokens, config);
  EXPECT_NEAR(uniform.text.item<double>(), std::log(double(config.text_classes())), 1e-5);
  EXPECT_NEAR(uniform.image.item<double>(), std::log(double(config.image_vocab_size)), 1e-5);
  EXPECT_NEAR(uniform.total.item<double>(),
              0.125 * std::log(double(config.text_classes())) + 0.875 * std::log(double(config.image_vocab_size)),
              1e-5);
  // Logits that put all mass on the right next token: text targets are the next ids with
  // padding replaced by its position's id, image targets the next codes, the first one
  // predicted from the last text position.
  auto perfect = torch::full({2, config.length(), classes}, -50.0);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t p = 0; p + 1 < config.length(); ++p) {
      int64_t next = tokens[b][p + 1].item<int64_t>();
      if (p + 1 < config.text_length) {
        if (next == 0) next = config.text_vocab_size + p + 1;
      } else {
        next += config.text_classes();
      }
      perfect[b][p][next] = 50.0;
    }
  }
  const auto best = prior_loss(perfect, tokens, config);
  EXPECT_LT(best.total.item<double>(), 1e-6);
}

TEST(Prior, TrainingStepsLowerTheLoss) {
  torch::manual_seed(2);
  auto config = tiny_config();
  Prior prior(config);
  const auto tokens = random_tokens(config, 4);
  torch::optim::AdamW optimizer(prior->parameters(), torch::optim::AdamWOptions(3e-3));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    auto loss = prior_loss(prior->forward(tokens), tokens, config).total;
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
  }
  EXPECT_LT(last, 0.5 * first);
}

TEST(Prior, RefusesBadTokensAndSizes) {
  Prior prior(tiny_config());
  auto tokens = random_tokens(tiny_config(), 1);
  tokens[0][7] = 12;  // an image code past the codebook
  EXPECT_THROW_WITH(prior->forward(tokens), Error, "image codes must lie in [0, 12)");
  EXPECT_THROW_WITH(prior->forward(torch::zeros({1, 40}, torch::kInt64)), Error, "do not fit the sequence of 31");
  auto config = tiny_config();
  config.heads = 5;
  EXPECT_THROW_WITH(Prior{config}, Error, "does not divide into 5 heads");
}

TEST(Prior, EmptyCaptionIsEndOfTextThenPadding) {
  static_assert(kCaptionPadId == text::Tokenizer::kPadId && kCaptionEndId == text::Tokenizer::kEndId,
                "the prior reads captions as the tokenizer writes them");
  const auto ids = empty_caption(5, 2);
  EXPECT_TRUE(torch::equal(ids[1], torch::tensor({3, 0, 0, 0, 0}, torch::kInt64)));
}

}  // namespace
}  // namespace dalle::models
