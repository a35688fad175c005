#include "dalle/models/bart_prior.h"
#include "dalle/models/bart_sampling.h"
#include "dalle/models/linear.h"
#include "dalle/models/vqgan_detokenizer.h"

#include <torch/torch.h>

#include <tuple>

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
  auto known = torch::arange(256) < 32;
  known.index_put_({Slice(200, 210)}, true);
  const ImagePrompt prompt{.tokens = torch::arange(256, torch::kInt64).remainder(16).unsqueeze(0), .known = known};
  DecodeGraphs kept;
  // A prompted call between unprompted ones: the kept mask and codes must not linger; the
  // settings change from call to call, read from the kept tensors.
  for (const auto& [images, seed, image_prompt] : std::vector<std::tuple<int64_t, int64_t, const ImagePrompt*>>{
           {3, 5, nullptr}, {3, 4, &prompt}, {2, 6, nullptr}, {3, 7, nullptr}}) {
    const BartSamplingOptions options{.temperature = 0.6 + 0.2 * static_cast<double>(seed % 3),
                                      .top_k = 4 + 2 * (seed % 3),
                                      .supercondition_factor = 2.0 + static_cast<double>(seed),
                                      .seed = seed};
    const auto captions = caption.expand({images, -1}).contiguous();
    const auto fresh =
        sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, nullptr, image_prompt);
    std::vector<torch::Tensor> seen;
    const auto with_kept = sample_bart_image_tokens(
        encoder_, decoder_, captions, options, {},
        [&](int64_t, int64_t, const torch::Tensor& codes) { seen.push_back(codes.clone()); }, {}, &kept, image_prompt);
    EXPECT_TRUE(torch::equal(with_kept, fresh)) << images << " images, seed " << seed;
    EXPECT_TRUE(torch::equal(torch::stack(seen, 1), fresh)) << "the callback sees each position's codes";
  }
  EXPECT_EQ(kept.graphs(), 0) << "the CPU captures nothing";
}

TEST_F(MinDalleParity, GraphsReplayedOnAGpuDrawTheCpusTokens) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "torch sees no CUDA device";
  const auto captions = at("sample.0.text_tokens")[1].expand({3, -1}).contiguous();
  const BartSamplingOptions options{.top_k = 8, .supercondition_factor = 4.0, .seed = 9};
  // An image prompt with kept cells after the first drawn one, which the replayed steps force.
  auto known = torch::arange(256) < 64;
  known.index_put_({Slice(130, 140)}, true);
  const ImagePrompt prompt{.tokens = torch::arange(256, torch::kInt64).remainder(16).unsqueeze(0), .known = known};
  const auto on_cpu = sample_bart_image_tokens(encoder_, decoder_, captions, options);
  const auto prompted_on_cpu =
      sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, nullptr, &prompt);
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

  // The prompt replays the graphs captured without one: its mask and codes are tensors they read.
  const int64_t captured = graphs.graphs(), replayed = graphs.replays();
  const auto prompted = sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, &graphs, &prompt);
  EXPECT_EQ(graphs.graphs(), captured) << "no graph captured anew";
  EXPECT_EQ(graphs.replays() - replayed, steps - 65) << "the 64 kept top positions in one call, then one replay a step";
  EXPECT_TRUE(torch::equal(prompted.cpu(), prompted_on_cpu));
  EXPECT_TRUE(
      torch::equal(prompted.cpu().index({Slice(), known}), prompt.tokens.index({Slice(), known}).expand({3, 74})));
  const auto after = sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, &graphs);
  EXPECT_TRUE(torch::equal(after.cpu(), on_cpu)) << "the prompt does not linger in the graphs' tensors";

  // Other settings replay the same graphs too: they are tensors the steps read.
  const BartSamplingOptions other{.temperature = 0.8, .top_k = 5, .supercondition_factor = 8.0, .seed = 9};
  const auto other_on_gpu = sample_bart_image_tokens(encoder_, decoder_, captions, other, {}, {}, {}, &graphs);
  EXPECT_EQ(graphs.graphs(), captured) << "no graph captured anew for other settings";
  encoder_->to(torch::kCPU);
  decoder_->to(torch::kCPU);
  EXPECT_TRUE(torch::equal(other_on_gpu.cpu(), sample_bart_image_tokens(encoder_, decoder_, captions, other)));
}

// The sampler one decoder step per position, written out here as sample_bart_image_tokens
// did it before image prompts: our stream draws on min-dalle's superconditioned weights. With
// `prompt`, a kept position's code replaces the draw before both rows read it.
torch::Tensor stepwise_reference(BartEncoder& encoder, BartDecoder& decoder, const torch::Tensor& captions,
                                 const BartSamplingOptions& options, const std::vector<uint64_t>& streams,
                                 const ImagePrompt* prompt = nullptr) {
  torch::NoGradGuard no_grad;
  const auto& config = decoder->config();
  const int64_t images = captions.size(0), length = config.image_length;
  const auto text = torch::cat({empty_captions(captions), captions});
  auto cache = decoder->start(encoder->forward(text), text);
  auto previous = torch::full({images, 1}, config.codes - 1, torch::kInt64);
  const auto uniforms = sampling_uniforms(options.seed, streams, length);
  std::vector<torch::Tensor> codes;
  for (int64_t index = 0; index < length; ++index) {
    const auto position = torch::full({1}, index, torch::kInt64);
    const auto logits =
        decoder->forward_step(torch::cat({previous, previous}), cache, position, index + 1).select(1, 0);
    auto next =
        draw_codes(supercondition_weights(logits.narrow(1, 0, config.codes), options), uniforms.select(1, index));
    if (prompt && prompt->known[index].item<bool>()) next = prompt->tokens.expand({images, length}).select(1, index);
    codes.push_back(next);
    previous = next.unsqueeze(1);
  }
  return torch::stack(codes, 1);
}

TEST_F(MinDalleParity, WithoutAnImagePromptTheTokensAreTheStepwiseDrawsAsBefore) {
  const auto captions = at("sample.0.text_tokens")[1].expand({2, -1}).contiguous();
  const BartSamplingOptions options{.top_k = 8, .supercondition_factor = 4.0, .seed = 3};
  const auto sampled = sample_bart_image_tokens(encoder_, decoder_, captions, options, {4, 9});
  EXPECT_TRUE(torch::equal(sampled, stepwise_reference(encoder_, decoder_, captions, options, {4, 9})))
      << "bit for bit";
  const ImagePrompt none{.tokens = torch::full({1, 256}, 3, torch::kInt64), .known = torch::zeros({256}, torch::kBool)};
  const auto keeping_nothing =
      sample_bart_image_tokens(encoder_, decoder_, captions, options, {4, 9}, {}, {}, nullptr, &none);
  EXPECT_TRUE(torch::equal(keeping_nothing, sampled)) << "a prompt that keeps nothing changes nothing";
}

TEST_F(MinDalleParity, ForcedTokensAreKeptAndTheRestDrawn) {
  const auto captions = at("sample.0.text_tokens")[1].expand({3, -1}).contiguous();
  const BartSamplingOptions options{.top_k = 8, .supercondition_factor = 4.0, .seed = 6};
  const std::vector<uint64_t> streams = {0, 1, 2};
  const auto tokens = torch::arange(256, torch::kInt64).remainder(13).unsqueeze(0);
  auto top_rows = torch::arange(256) < 3 * 16;  // the top three rows of the 16 x 16 grid
  auto holes = top_rows.clone();
  holes.index_put_({Slice(100, 104)}, true);  // and cells further down, forced by the steps
  auto scattered = torch::zeros({256}, torch::kBool);
  scattered.index_put_({Slice(5, 256, 37)}, true);  // the first position free: every position a step
  for (const auto& known : {top_rows, holes, scattered}) {
    const ImagePrompt prompt{.tokens = tokens, .known = known};
    std::vector<torch::Tensor> seen;
    const auto sampled = sample_bart_image_tokens(
        encoder_, decoder_, captions, options, streams,
        [&](int64_t done, int64_t total, const torch::Tensor& codes) {
          EXPECT_EQ(done, static_cast<int64_t>(seen.size()) + 1);
          EXPECT_EQ(total, 256);
          seen.push_back(codes.clone());
        },
        {}, nullptr, &prompt);
    const int64_t kept = known.sum().item<int64_t>();
    EXPECT_TRUE(torch::equal(sampled.index({Slice(), known}), tokens.index({Slice(), known}).expand({3, kept})));
    const auto free = sampled.index({Slice(), ~known});
    EXPECT_GE(free.min().item<int64_t>(), 0);
    EXPECT_LT(free.max().item<int64_t>(), 16) << "only the detokenizer's codes are drawn";
    EXPECT_FALSE(torch::equal(free[0], free[1])) << "the free positions are drawn, each image from its stream";
    ASSERT_EQ(seen.size(), 256u);
    EXPECT_TRUE(torch::equal(torch::stack(seen, 1), sampled)) << "the callback sees kept positions too";
    // The kept top rows go through the decoder at once, the rest step by step: the same tokens.
    EXPECT_TRUE(torch::equal(sampled, stepwise_reference(encoder_, decoder_, captions, options, streams, &prompt)));
  }
  const auto unprompted = sample_bart_image_tokens(encoder_, decoder_, captions, options, streams);
  const ImagePrompt prompt{.tokens = tokens, .known = top_rows};
  const auto prompted =
      sample_bart_image_tokens(encoder_, decoder_, captions, options, streams, {}, {}, nullptr, &prompt);
  EXPECT_FALSE(torch::equal(prompted.index({Slice(), Slice(48, 256)}), unprompted.index({Slice(), Slice(48, 256)})))
      << "the drawn rows follow the kept ones";
  const ImagePrompt whole{.tokens = tokens, .known = torch::ones({256}, torch::kBool)};
  const auto all_kept =
      sample_bart_image_tokens(encoder_, decoder_, captions, options, streams, {}, {}, nullptr, &whole);
  EXPECT_TRUE(torch::equal(all_kept, tokens.expand({3, 256})));
}

// A free position reads its own draw of the row's stream (or of torch's generator, which draws
// at every position): keeping a sample's own leading codes draws that sample again.
TEST_F(MinDalleParity, KeepingASamplesOwnTopRowsDrawsItAgainInAnyBatch) {
  const auto caption = at("sample.0.text_tokens")[1];
  const auto known = torch::arange(256) < 5 * 16;
  for (const bool torch_draws : {false, true}) {
    const BartSamplingOptions options{.top_k = 8, .supercondition_factor = 4.0, .seed = 11, .torch_draws = torch_draws};
    const auto alone = sample_bart_image_tokens(encoder_, decoder_, caption.unsqueeze(0), options, {7});
    const ImagePrompt own{.tokens = alone, .known = known};
    EXPECT_TRUE(torch::equal(
        sample_bart_image_tokens(encoder_, decoder_, caption.unsqueeze(0), options, {7}, {}, {}, nullptr, &own), alone))
        << "torch_draws " << torch_draws;
  }
  const BartSamplingOptions options{.top_k = 8, .supercondition_factor = 4.0, .seed = 11};
  const auto alone = sample_bart_image_tokens(encoder_, decoder_, caption.unsqueeze(0), options, {7});
  const ImagePrompt own{.tokens = alone, .known = known};
  const auto three = sample_bart_image_tokens(encoder_, decoder_, caption.expand({3, -1}).contiguous(), options,
                                              {6, 7, 8}, {}, {}, nullptr, &own);
  EXPECT_TRUE(torch::equal(three[1], alone[0])) << "the same stream in a batch of three";
  EXPECT_TRUE(torch::equal(three.index({Slice(), known}), alone.index({Slice(), known}).expand({3, 80})));
  EXPECT_FALSE(torch::equal(three[0], three[1])) << "other streams draw other free codes";
}

TEST_F(MinDalleParity, ImagePromptsOfOtherShapesOrCodesAreRefused) {
  const auto captions = at("sample.0.text_tokens")[1].expand({2, -1}).contiguous();
  const BartSamplingOptions options{.top_k = 4};
  const auto known = torch::arange(256) < 16;
  const ImagePrompt short_tokens{.tokens = torch::zeros({1, 255}, torch::kInt64), .known = known};
  EXPECT_THROW_WITH(sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, nullptr, &short_tokens),
                    Error, "tokens [1 or 2, 256]");
  const ImagePrompt three_rows{.tokens = torch::zeros({3, 256}, torch::kInt64), .known = known};
  EXPECT_THROW_WITH(sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, nullptr, &three_rows),
                    Error, "tokens [1 or 2, 256]");
  auto start_code = torch::zeros({1, 256}, torch::kInt64);
  start_code.index_put_({0, 3}, 16);  // min-dalle's start code, not one the detokenizer decodes
  const ImagePrompt beyond{.tokens = start_code, .known = known};
  EXPECT_THROW_WITH(sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, nullptr, &beyond),
                    Error, "kept tokens must lie in [0, 16)");
  const ImagePrompt elsewhere{.tokens = start_code, .known = torch::arange(256) >= 16};
  EXPECT_NO_THROW(sample_bart_image_tokens(encoder_, decoder_, captions, options, {}, {}, {}, nullptr, &elsewhere))
      << "only the kept positions must be codes";
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
