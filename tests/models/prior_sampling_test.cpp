#include "dalle/models/prior_sampling.h"

#include <torch/torch.h>

#include "test_support.h"

namespace dalle::models {
namespace {

using torch::indexing::Slice;

PriorConfig tiny_config() {
  PriorConfig config;
  config.text_length = 6;
  config.text_vocab_size = 20;
  config.grid_size = 4;
  config.image_vocab_size = 12;
  config.layers = 3;
  config.width = 32;
  config.heads = 4;
  config.conv_kernel = 3;
  return config;
}

torch::Tensor captions(int64_t batch) {
  return torch::tensor({2, 7, 9, 3, 0, 0}, torch::kInt64).repeat({batch, 1});
}

class PriorSampling : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(3);
    prior_ = Prior(tiny_config());
    prior_->eval();
    // Larger logits than at initialisation, so that samples depend on the caption.
    torch::NoGradGuard no_grad;
    for (auto& parameter : prior_->parameters()) parameter.mul_(4.0);
  }
  Prior prior_{nullptr};
};

TEST_F(PriorSampling, CachedAndUncachedDecodingGiveTheSameTokens) {
  SamplingOptions options{.top_k = 6, .seed = 11};
  const auto cached = sample_image_tokens(prior_, captions(3), options);
  options.use_cache = false;
  const auto uncached = sample_image_tokens(prior_, captions(3), options);
  EXPECT_EQ(cached.sizes(), (std::vector<int64_t>{3, 4, 4}));
  EXPECT_TRUE(torch::equal(cached, uncached));
}

TEST_F(PriorSampling, TheSeedDecides) {
  const auto first = sample_image_tokens(prior_, captions(2), {.seed = 1});
  EXPECT_TRUE(torch::equal(first, sample_image_tokens(prior_, captions(2), {.seed = 1})));
  EXPECT_FALSE(torch::equal(first, sample_image_tokens(prior_, captions(2), {.seed = 2})));
  // Rows of one batch are different samples.
  EXPECT_FALSE(torch::equal(first[0], first[1]));
}

TEST_F(PriorSampling, ZeroGuidanceSamplesTheUnconditionalModel) {
  const auto guided = sample_image_tokens(prior_, captions(2), {.guidance_scale = 0.0, .seed = 5});
  const auto unconditional = sample_image_tokens(prior_, empty_caption(6, 2), {.seed = 5});
  EXPECT_TRUE(torch::equal(guided, unconditional));
}

TEST_F(PriorSampling, ImagePromptPositionsAreKept) {
  const auto reference = sample_image_tokens(prior_, captions(1), {.seed = 9});
  auto known = torch::zeros({16}, torch::kBool);
  known.index_put_({Slice(0, 8)}, true);  // the top two rows
  const ImagePrompt prompt{.tokens = torch::full({1, 16}, 7, torch::kInt64), .known = known};
  for (bool use_cache : {true, false}) {
    const auto sampled = sample_image_tokens(prior_, captions(2), {.use_cache = use_cache, .seed = 9}, &prompt)
                             .view({2, 16});
    EXPECT_TRUE(torch::equal(sampled.index({Slice(), Slice(0, 8)}), torch::full({2, 8}, 7, torch::kInt64)));
  }
  const auto cached = sample_image_tokens(prior_, captions(2), {.seed = 4}, &prompt);
  const auto uncached = sample_image_tokens(prior_, captions(2), {.use_cache = false, .seed = 4}, &prompt);
  EXPECT_TRUE(torch::equal(cached, uncached));
  EXPECT_FALSE(torch::equal(reference.view({16}).index({Slice(0, 8)}), torch::full({8}, 7, torch::kInt64)));
}

TEST(FilterLogits, TopKAndTopP) {
  const auto logits = torch::log(torch::tensor({{0.1, 0.5, 0.3, 0.1}}));
  const auto top2 = filter_logits(logits, {.top_k = 2});
  EXPECT_TRUE(torch::equal(torch::isinf(top2), torch::tensor({{true, false, false, true}})));
  // 0.5 + 0.3 reaches 0.7: the third likeliest is dropped.
  const auto nucleus = filter_logits(logits, {.top_p = 0.7});
  EXPECT_TRUE(torch::equal(torch::isinf(nucleus), torch::tensor({{true, false, false, true}})));
  // A tiny p keeps only the likeliest code.
  EXPECT_EQ(torch::isfinite(filter_logits(logits, {.top_p = 1e-3})).sum().item<int64_t>(), 1);
  EXPECT_TRUE(torch::allclose(filter_logits(logits, {.temperature = 2.0}), logits / 2.0));
}

TEST(Sampling, RefusesMisshapenCaptions) {
  Prior prior(tiny_config());
  EXPECT_THROW_WITH(sample_image_tokens(prior, torch::zeros({1, 5}, torch::kInt64), {}), Error,
                    "expected captions [batch, 6]");
}

}  // namespace
}  // namespace dalle::models
