#include "dalle/models/bart_prior.h"
#include "dalle/models/bart_sampling.h"
#include "dalle/models/linear.h"
#include "dalle/models/vqgan_detokenizer.h"

#include <torch/torch.h>

#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"
#include "test_support.h"

namespace dalle::models {
namespace {

using testing::relative_error;
using torch::indexing::Slice;

// The sizes of tests/fixtures/mindalle_parity.safetensors (tests/parity/make_mindalle_fixture.py):
// min-dalle 0.4.11's own classes with random weights.
BartPriorConfig fixture_config() {
  return {.layers = 2, .heads = 4, .width = 32, .glu_width = 44, .text_vocab_size = 49, .image_vocab_size = 19,
          .codes = 16};
}

class MinDalleParity : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::NoGradGuard no_grad;
    io::load_state_dict(*encoder_, testing::dequantized_weights(fixture_.tensors, "encoder."));
    io::load_state_dict(*decoder_, testing::dequantized_weights(fixture_.tensors, "decoder."));
    encoder_->eval();
    decoder_->eval();
  }
  const torch::Tensor& at(const std::string& name) const { return fixture_.tensors.at(name); }
  // The generator's rows for n = 2 images: two unconditioned, then two conditioned.
  std::pair<torch::Tensor, torch::Tensor> decoder_captions() {
    const auto rows = at("decoder.input.encoder_rows");
    return {encoder_->forward(at("encoder.input.text_tokens")).index_select(0, rows),
            at("encoder.input.text_tokens").index_select(0, rows)};
  }
  // Each image's previous tokens, for both of its rows.
  torch::Tensor previous_tokens() const { return at("decoder.input.prev_tokens").repeat({2, 1}); }

  io::Safetensors fixture_ = io::read_safetensors(testing::fixture_path("mindalle_parity.safetensors"));
  BartEncoder encoder_{fixture_config()};
  BartDecoder decoder_{fixture_config()};
};

TEST_F(MinDalleParity, EncoderOutputMatches) {
  torch::NoGradGuard no_grad;
  const auto encoding = encoder_->forward(at("encoder.input.text_tokens"));
  EXPECT_EQ(encoding.sizes(), at("encoder.output").sizes());
  EXPECT_LT(relative_error(encoding, at("encoder.output")), 1e-5);
}

TEST_F(MinDalleParity, EveryCachedStepMatchesAndSoDoesTheWholeSequence) {
  torch::NoGradGuard no_grad;
  const auto [encoding, text] = decoder_captions();
  const auto tokens = previous_tokens();
  auto cache = decoder_->start(encoding, text);
  const int64_t steps = at("decoder.output.step_logits").size(0);
  for (int64_t step = 0; step < steps; ++step) {
    const auto logits = decoder_->forward(tokens.index({Slice(), Slice(step, step + 1)}), cache);
    EXPECT_LT(relative_error(logits.squeeze(1), at("decoder.output.step_logits")[step]), 1e-5) << "step " << step;
  }
  // min-dalle's cache [layer, 4n, position, d]: the rows' keys, then their values.
  const auto& expected = at("decoder.output.kv_cache");
  for (size_t layer = 0; layer < cache.keys.size(); ++layer) {
    const auto as_theirs = [&](const torch::Tensor& ours) {
      return ours.index({Slice(), Slice(), Slice(0, steps)}).transpose(1, 2).reshape({4, steps, -1});
    };
    const auto theirs = torch::cat({as_theirs(cache.keys[layer]), as_theirs(cache.values[layer])});
    EXPECT_LT(relative_error(theirs, expected[static_cast<int64_t>(layer)]), 1e-5) << "layer " << layer;
    EXPECT_EQ(cache.keys[layer].index({Slice(), Slice(), Slice(steps)}).abs().max().item<float>(), 0.0f);
  }
  auto whole = decoder_->start(encoding, text);
  EXPECT_LT(relative_error(decoder_->forward(tokens, whole), at("decoder.output.full_logits")), 1e-5);
}

// int8 weights (dtype int8) against min-dalle's float32 logits, step by step: the next code's
// agreement and the logits' largest difference, printed and bounded.
TEST_F(MinDalleParity, Int8WeightsMostlyPickMinDallesNextCode) {
  torch::NoGradGuard no_grad;
  EXPECT_GT(quantize_linears_int8(*encoder_) + quantize_linears_int8(*decoder_), 0);
  const auto [encoding, text] = decoder_captions();
  const auto tokens = previous_tokens();
  auto cache = decoder_->start(encoding, text);
  const int64_t steps = at("decoder.output.step_logits").size(0);
  std::vector<torch::Tensor> ours, theirs;
  for (int64_t step = 0; step < steps; ++step) {
    ours.push_back(decoder_->forward(tokens.index({Slice(), Slice(step, step + 1)}), cache).squeeze(1));
    theirs.push_back(at("decoder.output.step_logits")[step]);
  }
  const auto got = torch::stack(ours), expected = torch::stack(theirs);
  const double agreement = (got.argmax(-1) == expected.argmax(-1)).to(torch::kFloat64).mean().item<double>();
  const double error = relative_error(got, expected);
  std::printf("int8 against min-dalle: next code agrees at %.1f%% of %lld, relative error %.3g\n", 100 * agreement,
              static_cast<long long>(got.numel() / got.size(-1)), error);
  EXPECT_GE(agreement, 0.8);
  EXPECT_GT(error, 1e-5) << "the int8 product, not float32's";
  EXPECT_LT(error, 0.1);
}

// min-dalle's generate_raw_image_stream, end to end: settings (seed, grid side, temperature,
// top_k, supercondition factor) of two runs, the second on a caption cut at 64 ids.
TEST_F(MinDalleParity, TorchDrawsGiveMinDallesTokensAndWeights) {
  for (const std::string run : {"sample.0.", "sample.1."}) {
    const auto settings = at(run + "settings");
    const int64_t images = settings[1].item<int64_t>() * settings[1].item<int64_t>();
    const BartSamplingOptions options{.temperature = settings[2].item<double>(), .top_k = settings[3].item<int64_t>(),
                                      .supercondition_factor = settings[4].item<double>(),
                                      .seed = settings[0].item<int64_t>(), .torch_draws = true};
    const auto text = at(run + "text_tokens");
    const auto captions = text[1].expand({images, -1}).contiguous();
    EXPECT_TRUE(torch::equal(empty_captions(captions)[0], text[0])) << run;
    EXPECT_TRUE(torch::equal(sample_bart_image_tokens(encoder_, decoder_, captions, options), at(run + "image_tokens")))
        << run;

    // The weights of the first steps, given min-dalle's tokens.
    torch::NoGradGuard no_grad;
    const auto rows = torch::cat({empty_captions(captions), captions});
    auto cache = decoder_->start(encoder_->forward(rows), rows);
    const auto drawn = at(run + "image_tokens");
    auto previous = torch::full({images, 1}, 15, torch::kInt64);
    for (int64_t step = 0; step < at(run + "weights_first_8_steps").size(0); ++step) {
      const auto logits = decoder_->forward(torch::cat({previous, previous}), cache).select(1, 0).narrow(1, 0, 16);
      EXPECT_LT(relative_error(supercondition_weights(logits, options), at(run + "weights_first_8_steps")[step]), 1e-5)
          << run << " step " << step;
      previous = drawn.narrow(1, step, 1);
    }
  }
}

// Our draws: each image from its stream, the same in any batch.
TEST_F(MinDalleParity, StreamDrawsDoNotDependOnTheBatch) {
  const auto caption = at("sample.0.text_tokens")[1];
  const BartSamplingOptions options{.top_k = 8, .supercondition_factor = 4.0, .seed = 5};
  const auto three = sample_bart_image_tokens(encoder_, decoder_, caption.expand({3, -1}).contiguous(), options,
                                              {10, 11, 12});
  const auto alone = sample_bart_image_tokens(encoder_, decoder_, caption.unsqueeze(0), options, {11});
  EXPECT_TRUE(torch::equal(three[1], alone[0]));
  EXPECT_FALSE(torch::equal(three[0], three[1])) << "other streams, other images";
  EXPECT_EQ(three.max().item<int64_t>() < 16, true) << "only the detokenizer's codes are drawn";
  EXPECT_THROW_WITH(sample_bart_image_tokens(encoder_, decoder_, caption.unsqueeze(0), {.top_k = 17}), Error,
                    "top_k 17 outside [1, 16]");
  EXPECT_THROW_WITH(sample_bart_image_tokens(encoder_, decoder_, caption.unsqueeze(0), {.temperature = 0, .top_k = 4}),
                    Error, "temperature must be positive");
  EXPECT_THROW_WITH(sample_bart_image_tokens(encoder_, decoder_, caption, {.top_k = 4}), Error,
                    "expected captions [B, 64]");
}

TEST_F(MinDalleParity, StepTensorsKeptAcrossCallsDrawWhatFreshOnesDraw) {
  const auto caption = at("sample.0.text_tokens")[1];
  DecodeGraphs kept;
  for (const auto& [images, seed] : std::vector<std::pair<int64_t, int64_t>>{{3, 5}, {2, 6}, {3, 7}}) {
    const BartSamplingOptions options{.top_k = 8, .supercondition_factor = 4.0, .seed = seed};
    const auto captions = caption.expand({images, -1}).contiguous();
    const auto fresh = sample_bart_image_tokens(encoder_, decoder_, captions, options);
    std::vector<torch::Tensor> seen;
    const auto with_kept = sample_bart_image_tokens(
        encoder_, decoder_, captions, options, {},
        [&](int64_t, int64_t, const torch::Tensor& codes) { seen.push_back(codes.clone()); }, {}, &kept);
    EXPECT_TRUE(torch::equal(with_kept, fresh)) << images << " images, seed " << seed;
    EXPECT_TRUE(torch::equal(torch::stack(seen, 1), fresh)) << "the callback sees each position's codes";
  }
  EXPECT_EQ(kept.graphs(), 0) << "the CPU captures nothing";
}

TEST_F(MinDalleParity, GraphsReplayedOnAGpuDrawTheCpusTokens) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "torch sees no CUDA device";
  const auto captions = at("sample.0.text_tokens")[1].expand({3, -1}).contiguous();
  const BartSamplingOptions options{.top_k = 8, .supercondition_factor = 4.0, .seed = 9};
  const auto on_cpu = sample_bart_image_tokens(encoder_, decoder_, captions, options);
  encoder_->to(torch::kCUDA);
  decoder_->to(torch::kCUDA);
  DecodeGraphs graphs, eager(/*enabled=*/false);
  const auto first = sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, &graphs);
  const auto again = sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, &graphs);
  const auto launched = sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, &eager);
  const int64_t steps = decoder_->config().image_length;
  EXPECT_EQ(graphs.graphs(), (steps + DecodeGraphs::kBucket - 1) / DecodeGraphs::kBucket);
  EXPECT_EQ(graphs.replays(), 2 * steps - graphs.graphs());
  EXPECT_TRUE(torch::equal(first.cpu(), on_cpu));
  EXPECT_TRUE(torch::equal(again.cpu(), on_cpu));
  EXPECT_TRUE(torch::equal(launched.cpu(), on_cpu));
}

// min-dalle's detokenizer at the fixture's widths (8, 16, 16 for 128, 256, 512): 2 x 2
// tokens per image, 16x upsampling, four images laid out column-major.
TEST_F(MinDalleParity, DetokenizerImagesMatch) {
  VqganConfig config;
  config.ch = 8;
  config.ch_mult = {1, 1, 2, 2, 2};
  config.attn_resolutions = {2};
  config.z_channels = config.embed_dim = 8;
  config.n_embed = 16;
  config.resolution = 32;
  config.norm_groups = 4;
  VqganDetokenizer detokenizer(config);
  io::load_state_dict(*detokenizer, testing::dequantized_weights(fixture_.tensors, "detokenizer."));
  torch::NoGradGuard no_grad;
  const auto images = detokenizer->forward(at("detokenizer.input.tokens"));
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{4, 3, 32, 32}));
  EXPECT_LT(relative_error(min_dalle_grid(images), at("detokenizer.output.image")), 1e-4);
  EXPECT_EQ(dalle_mega_detokenizer_config().downsampling_factor(), 16);
}

TEST_F(MinDalleParity, MissingScaleFreeGainsLoadAsOnesAndOthersAreNamed) {
  auto state = testing::dequantized_weights(fixture_.tensors, "decoder.");
  state.erase("layers.1.glu.ln1.weight");
  state.erase("layers.0.pre_encoder_attn_layer_norm.weight");
  BartDecoder decoder(fixture_config());
  io::load_state_dict(*decoder, with_unit_layer_norm_gains(state, *decoder));
  const auto loaded = io::state_dict(*decoder);
  EXPECT_TRUE(torch::equal(loaded.at("layers.1.glu.ln1.weight"), torch::ones({44})));
  EXPECT_TRUE(torch::equal(loaded.at("layers.0.pre_encoder_attn_layer_norm.weight"), torch::ones({32})));
  state.erase("layers.0.self_attn_layer_norm.weight");  // has a scale in min-dalle's files
  EXPECT_THROW_WITH(io::load_state_dict(*decoder, with_unit_layer_norm_gains(state, *decoder)), Error,
                    "layers.0.self_attn_layer_norm.weight");
}

// Parameters by docs/mega-prior.md's formula: embeddings, then per layer 4d^2 + 3dg + 6d + 2g
// in the encoder and 8d^2 + 3dg + 10d + 2g in the decoder, and the decoder's head.
int64_t counted_parameters(const BartPriorConfig& c) {
  const int64_t d = c.width, g = c.glu_width, images = c.image_vocab_size + 1;
  const int64_t encoder =
      (c.text_vocab_size + c.text_length) * d + 4 * d + c.layers * (4 * d * d + 3 * d * g + 6 * d + 2 * g);
  const int64_t decoder =
      (images + c.image_length) * d + 4 * d + c.layers * (8 * d * d + 3 * d * g + 10 * d + 2 * g) + images * d;
  return encoder + decoder;
}

TEST(BartPrior, MegaAndMiniHaveMinDallesSizes) {
  int64_t built = 0;
  for (const auto& p : BartEncoder(fixture_config())->parameters()) built += p.numel();
  for (const auto& p : BartDecoder(fixture_config())->parameters()) built += p.numel();
  EXPECT_EQ(built, counted_parameters(fixture_config()));
  // min-dalle's DalleBartEncoder + DalleBartDecoder, counted in Python.
  EXPECT_EQ(counted_parameters(dalle_mega_config()), 2587967488);
  EXPECT_EQ(counted_parameters(dalle_mini_config()), 437962720);
  auto bad = fixture_config();
  bad.heads = 5;
  EXPECT_THROW_WITH(BartEncoder{bad}, Error, "width 32 is not divisible by heads 5");
}

}  // namespace
}  // namespace dalle::models
