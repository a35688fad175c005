#include "dalle/models/prior_sampling.h"

#include <torch/torch.h>

#include <cmath>

#include "test_support.h"

namespace dalle::models {
namespace {

using torch::indexing::Slice;

PriorConfig tiny_config() {
  return {.text_length = 6, .text_vocab_size = 20, .grid_size = 4, .image_vocab_size = 12, .layers = 3, .width = 32,
          .heads = 4, .conv_kernel = 3};
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

TEST_F(PriorSampling, ARowDrawsTheSameTokensInAnyBatch) {
  auto mixed = captions(3);
  mixed.index_put_({1, Slice(1, 3)}, torch::tensor({11, 12}));
  const SamplingOptions options{.guidance_scale = 2.0, .seed = 6};
  const auto together = sample_image_tokens(prior_, mixed, options, nullptr, {}, {40, 41, 42});
  for (int64_t row = 0; row < 3; ++row) {
    const auto alone = sample_image_tokens(prior_, mixed.index({Slice(row, row + 1)}), options, nullptr, {},
                                           {static_cast<uint64_t>(40 + row)});
    EXPECT_TRUE(torch::equal(alone[0], together[row])) << "row " << row;
  }
  // The default streams are the row numbers.
  EXPECT_TRUE(torch::equal(sample_image_tokens(prior_, mixed, options),
                           sample_image_tokens(prior_, mixed, options, nullptr, {}, {0, 1, 2})));
  EXPECT_THROW_WITH(sample_image_tokens(prior_, mixed, options, nullptr, {}, {0, 1}), Error,
                    "2 streams for 3 captions");
}

TEST_F(PriorSampling, EachRowMayHaveItsOwnSeed) {
  const SamplingOptions options{.top_k = 6, .seed = 0};
  const auto together = sample_image_tokens(prior_, captions(3), options, nullptr, {}, {0, 5, 1}, nullptr, {7, 8, 7});
  const std::vector<std::pair<int64_t, uint64_t>> seed_and_stream = {{7, 0}, {8, 5}, {7, 1}};
  for (size_t row = 0; row < seed_and_stream.size(); ++row) {
    auto alone_options = options;
    alone_options.seed = seed_and_stream[row].first;
    const auto alone = sample_image_tokens(prior_, captions(1), alone_options, nullptr, {}, {seed_and_stream[row].second});
    EXPECT_TRUE(torch::equal(alone[0], together[static_cast<int64_t>(row)])) << "row " << row;
  }
  EXPECT_THROW_WITH(sample_image_tokens(prior_, captions(3), options, nullptr, {}, {}, nullptr, {1, 2}), Error,
                    "2 seeds for 3 rows");
  EXPECT_TRUE(torch::equal(sampling_uniforms(std::vector<int64_t>{4, 9}, {2, 3}, 16)[1], sampling_uniforms(9, {3}, 16)[0]));
}

TEST(SamplingUniforms, FixedPerSeedStreamAndPositionAndUniform) {
  const auto uniforms = sampling_uniforms(3, {0, 1, 1ull << 32}, 4096);
  EXPECT_EQ(uniforms.sizes(), (std::vector<int64_t>{3, 4096}));
  EXPECT_TRUE(torch::equal(uniforms.index({Slice(1, 2)}), sampling_uniforms(3, {1}, 4096)));
  EXPECT_TRUE(torch::equal(uniforms.index({Slice(), Slice(0, 7)}), sampling_uniforms(3, {0, 1, 1ull << 32}, 7)));
  EXPECT_FALSE(torch::equal(uniforms[0], uniforms[1]));
  EXPECT_FALSE(torch::equal(uniforms, sampling_uniforms(4, {0, 1, 1ull << 32}, 4096)));
  EXPECT_GT(uniforms.min().item<float>(), 0.0f);
  EXPECT_LT(uniforms.max().item<float>(), 1.0f);
  // Uniform: each tenth of (0, 1) holds a tenth of 12288 draws, within 5 standard deviations (33).
  const auto deciles = torch::histc(uniforms, 10, 0.0, 1.0);
  EXPECT_LT((deciles - 1228.8).abs().max().item<double>(), 170.0) << deciles;
  // Neighbouring positions are uncorrelated.
  const auto centred = uniforms.flatten() - 0.5;
  const double correlation = (centred.narrow(0, 0, 12287) * centred.narrow(0, 1, 12287)).mean().item<double>() / (1.0 / 12);
  EXPECT_LT(std::abs(correlation), 0.05);
}

TEST(DrawCodes, InvertsTheCumulativeSumAndSkipsImpossibleCodes) {
  const auto probabilities = torch::tensor({{0.0, 0.5, 0.0, 0.5}}).repeat({6, 1});
  const auto codes = draw_codes(probabilities, torch::tensor({0.1f, 0.25f, 0.5f, 0.51f, 0.75f, 0.99999f}));
  EXPECT_TRUE(torch::equal(codes, torch::tensor({1, 1, 1, 3, 3, 3}, torch::kInt64))) << codes;
  // Unnormalised rows are scaled by their sum.
  EXPECT_EQ(draw_codes(torch::tensor({{2.0, 6.0}}), torch::tensor({0.3f})).item<int64_t>(), 1);
  // Drawn at many uniforms, codes come out in proportion to their probabilities.
  const auto skewed = torch::tensor({{0.1, 0.2, 0.0, 0.7}});
  const auto counts = torch::bincount(draw_codes(skewed.repeat({10000, 1}), sampling_uniforms(1, {0}, 10000)[0]), {}, 4);
  EXPECT_TRUE(torch::allclose(counts.to(torch::kDouble) / 10000, skewed[0].to(torch::kDouble), 0.0, 0.02)) << counts;
  EXPECT_EQ(counts[2].item<int64_t>(), 0);
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

TEST_F(PriorSampling, StepTensorsKeptAcrossCallsDrawWhatFreshOnesAndTheReferenceDraw) {
  auto known = torch::zeros({16}, torch::kBool);
  known.index_put_({Slice(0, 4)}, true);  // the top row,
  known.index_put_({9}, true);            // and a cell after the first drawn one: a step keeps it
  const ImagePrompt prompt{.tokens = torch::arange(16, torch::kInt64).remainder(12).unsqueeze(0), .known = known};
  struct Call {
    int64_t batch;
    SamplingOptions options;
    const ImagePrompt* prompt;
  };
  // Settings change from call to call: a kept step reads them from its tensors.
  const std::vector<Call> calls = {{2, {.top_k = 6, .seed = 1}, nullptr},
                                   {2, {.guidance_scale = 3.0, .seed = 2}, nullptr},
                                   {3, {.top_p = 0.8, .seed = 3}, &prompt},
                                   {2, {.top_k = 6, .seed = 4}, nullptr},
                                   {2, {.temperature = 0.7, .top_k = 5, .top_p = 0.9, .guidance_scale = 2.5, .seed = 5},
                                    &prompt},
                                   {2, {.temperature = 1.3, .guidance_scale = 1.5, .seed = 6}, nullptr}};
  DecodeGraphs kept;
  for (const auto& call : calls) {
    const auto fresh = sample_image_tokens(prior_, captions(call.batch), call.options, call.prompt);
    const auto with_kept =
        sample_image_tokens(prior_, captions(call.batch), call.options, call.prompt, {}, {}, nullptr, {}, &kept);
    auto recomputed = call.options;
    recomputed.use_cache = false;
    EXPECT_TRUE(torch::equal(with_kept, fresh)) << "seed " << call.options.seed;
    EXPECT_TRUE(torch::equal(fresh, sample_image_tokens(prior_, captions(call.batch), recomputed, call.prompt)))
        << "seed " << call.options.seed;
    if (call.prompt) {
      const auto flat = fresh.view({call.batch, 16});
      EXPECT_TRUE(torch::equal(flat.index({Slice(), known}), prompt.tokens.index({Slice(), known}).expand({call.batch, 5})));
    }
  }
  EXPECT_EQ(kept.graphs(), 0) << "the CPU captures nothing";
}

TEST_F(PriorSampling, TheCallbackSeesEachPositionsCodesAndAWholePromptIsReturned) {
  std::vector<torch::Tensor> seen;
  const auto tokens = sample_image_tokens(prior_, captions(2), {.seed = 8}, nullptr,
                                          [&](int64_t done, int64_t total, const torch::Tensor& codes) {
                                            EXPECT_EQ(done, static_cast<int64_t>(seen.size()) + 1);
                                            EXPECT_EQ(total, 16);
                                            seen.push_back(codes.clone());
                                          });
  ASSERT_EQ(seen.size(), 16u);
  EXPECT_TRUE(torch::equal(torch::stack(seen, 1), tokens.view({2, 16})));
  const ImagePrompt whole{.tokens = torch::full({1, 16}, 3, torch::kInt64), .known = torch::ones({16}, torch::kBool)};
  EXPECT_TRUE(torch::equal(sample_image_tokens(prior_, captions(2), {.seed = 8}, &whole),
                           torch::full({2, 4, 4}, 3, torch::kInt64)));
}

TEST_F(PriorSampling, GraphsReplayedOnAGpuDrawTheCpusTokens) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "torch sees no CUDA device";
  const SamplingOptions options{.top_k = 6, .guidance_scale = 2.0, .seed = 12};
  const auto on_cpu = sample_image_tokens(prior_, captions(3), options);
  prior_->to(torch::kCUDA);
  DecodeGraphs graphs, eager(/*enabled=*/false);
  const auto first = sample_image_tokens(prior_, captions(3), options, nullptr, {}, {}, nullptr, {}, &graphs);
  const auto again = sample_image_tokens(prior_, captions(3), options, nullptr, {}, {}, nullptr, {}, &graphs);
  const auto launched = sample_image_tokens(prior_, captions(3), options, nullptr, {}, {}, nullptr, {}, &eager);
  EXPECT_EQ(graphs.graphs(), 1) << "22 positions: one bucket";
  EXPECT_EQ(graphs.replays(), 2 * 15 - 1);
  EXPECT_TRUE(torch::equal(first.cpu(), on_cpu));
  EXPECT_TRUE(torch::equal(again.cpu(), on_cpu));
  EXPECT_TRUE(torch::equal(launched.cpu(), on_cpu));
}

// One graph per batch shape serves requests of any temperature, filters, guidance scale and
// image prompt: none of them drops it, and the replays draw the CPU's tokens.
TEST_F(PriorSampling, OnAGpuSettingsOfEachCallAreReadByTheSameGraph) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "torch sees no CUDA device";
  const ImagePrompt prompt{.tokens = torch::arange(16, torch::kInt64).remainder(12).unsqueeze(0),
                           .known = torch::arange(16) < 4};
  struct Call {
    SamplingOptions options;
    const ImagePrompt* prompt;
  };
  const std::vector<Call> calls = {{{.top_k = 6, .guidance_scale = 2.0, .seed = 12}, nullptr},
                                   {{.temperature = 0.7, .top_p = 0.9, .guidance_scale = 3.0, .seed = 13}, nullptr},
                                   {{.top_k = 4, .guidance_scale = 1.5, .seed = 14}, &prompt},
                                   {{.temperature = 1.4, .guidance_scale = 2.0, .seed = 15}, nullptr}};
  std::vector<torch::Tensor> on_cpu;
  for (const auto& call : calls) on_cpu.push_back(sample_image_tokens(prior_, captions(3), call.options, call.prompt));
  prior_->to(torch::kCUDA);
  DecodeGraphs graphs;
  for (size_t i = 0; i < calls.size(); ++i) {
    const auto drawn =
        sample_image_tokens(prior_, captions(3), calls[i].options, calls[i].prompt, {}, {}, nullptr, {}, &graphs);
    EXPECT_TRUE(torch::equal(drawn.cpu(), on_cpu[i])) << "call " << i;
    EXPECT_EQ(graphs.graphs(), 1) << "call " << i << ": the first call's graph, never dropped";
  }
  EXPECT_EQ(graphs.replays(), 14 + 15 + 11 + 15) << "every step after the first capture replayed";
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

// Each row of a batch filtered with its own top_k and top_p, exactly as alone.
TEST(FilterLogits, PerRowFiltersEqualEachRowFilteredAlone) {
  torch::manual_seed(5);
  const auto logits = 3 * torch::randn({5, 40});
  const RowFilters filters{.top_k = {0, 5, 0, 7, 40}, .top_p = {1.0, 1.0, 0.9, 0.5, 0.995}};
  const auto filtered = filter_logits(logits, 1.5, filters);
  for (int64_t row = 0; row < 5; ++row) {
    const SamplingOptions alone{.temperature = 1.5, .top_k = filters.top_k[static_cast<size_t>(row)],
                                .top_p = filters.top_p[static_cast<size_t>(row)]};
    EXPECT_TRUE(torch::equal(filtered[row], filter_logits(logits.slice(0, row, row + 1), alone)[0])) << row;
  }
  EXPECT_EQ(torch::isfinite(filtered[1]).sum().item<int64_t>(), 5);
  EXPECT_EQ(torch::isfinite(filtered[0]).sum().item<int64_t>(), 40);
}

TEST(Sampling, RefusesMisshapenCaptions) {
  Prior prior(tiny_config());
  EXPECT_THROW_WITH(sample_image_tokens(prior, torch::zeros({1, 5}, torch::kInt64), {}), Error,
                    "expected captions [batch, 6]");
}

}  // namespace
}  // namespace dalle::models
