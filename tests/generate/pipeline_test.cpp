#include "dalle/generate/pipeline.h"

#include <atomic>
#include <chrono>
#include <future>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <thread>

#include "dalle/data/image.h"
#include "dalle/data/png_text.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/adapter.h"
#include "dalle/models/clip_rerank.h"
#include "dalle/models/linear.h"
#include "dalle/models/trained.h"
#include "dalle/text/clip_tokenizer.h"
#include "dalle/text/tokenizer.h"
#include "dalle/text/yttm_tokenizer.h"
#include "test_support.h"

namespace dalle::generate {
namespace {

TEST(PipelineConfig, KeepingFewerThanSampledNeedsClip) {
  PipelineConfig config;
  config.prior = "runs/none";
  config.candidates = 8;
  config.keep = 2;
  EXPECT_THROW_WITH(Pipeline{config}, Error, "keeping 2 of 8 candidates needs a CLIP model");
  config.keep = 9;
  EXPECT_THROW_WITH(Pipeline{config}, Error, "keep (9) exceeds candidates (8)");
  config.keep = 0;
  EXPECT_EQ(config.kept(), 8);
}

TEST(PipelineConfig, MissingPriorIsNamed) {
  EXPECT_THROW_WITH(Pipeline{PipelineConfig{}}, Error, "`prior` is required");
  testing::ScratchDir dir;
  PipelineConfig config;
  config.prior = dir / "absent";
  EXPECT_THROW_WITH(Pipeline{config}, Error, "absent");
}

TEST(PipelineConfig, UnknownKeysAndBadValuesAreRefused) {
  EXPECT_THROW_WITH(load_config<PipelineConfig>(ConfigSource::from_string("prior: p\ncandidate: 4\n", "g.yaml")),
                    ConfigError, "g.yaml:2:1: unknown key 'candidate'");
  EXPECT_THROW_WITH(load_config<PipelineConfig>(ConfigSource::from_string("device: tpu\n", "g.yaml")), ConfigError,
                    "device");
}

// The shipped demo models: an 8x8 token grid from a 64-pixel VQGAN.
PipelineConfig demo_pipeline(int64_t candidates) {
  const std::string models = std::string(DALLE_SOURCE_DIR) + "/models/fashion-compose-f8/";
  return {.prior = models + "prior", .tokenizer = models + "tokenizer.model", .decoder = models + "vqgan",
          .candidates = candidates, .sampling = {.seed = 3}, .threads = 2};
}

// The tokens of `picture` under the demo's VQGAN (or the one at `vqgan`), [64].
torch::Tensor demo_tokens(const std::string& picture,
                          const std::string& vqgan_path = std::string(DALLE_SOURCE_DIR) +
                                                          "/models/fashion-compose-f8/vqgan") {
  auto vqgan = models::load_image_tokenizer(vqgan_path);
  torch::NoGradGuard no_grad;
  return vqgan.model->encode_tokens(data::read_image(picture).unsqueeze(0)).flatten();
}

class ImagePrompt : public ::testing::Test {
 protected:
  // A picture to continue: one the demo draws itself.
  void SetUp() override {
    Pipeline pipeline(demo_pipeline(1));
    data::write_png(picture_, pipeline.generate({"a red bag on the left"}).at(0).image);
    expected_ = demo_tokens(picture_);
  }

  // The candidates' tokens, [candidates, 64], for `prompt` continuing the picture.
  torch::Tensor continued(const ImagePromptConfig& prompt) {
    auto config = demo_pipeline(4);
    config.image_prompt = prompt;
    std::vector<torch::Tensor> tokens;
    for (const auto& image : Pipeline(config).generate({"a blue sneaker at the top"})) {
      tokens.push_back(image.tokens.flatten());
    }
    return torch::stack(tokens);
  }

  testing::ScratchDir dir_;
  std::string picture_ = dir_ / "picture.png";
  torch::Tensor expected_;
};

TEST_F(ImagePrompt, SamplesKeepTheTopRowsAndDrawTheRest) {
  using torch::indexing::Slice;
  const auto tokens = continued({.image = picture_, .top_rows = 3});
  for (int64_t c = 0; c < tokens.size(0); ++c) {
    EXPECT_TRUE(torch::equal(tokens[c].index({Slice(0, 24)}), expected_.index({Slice(0, 24)}))) << c;
  }
  const auto drawn = tokens.index({Slice(), Slice(24, torch::indexing::None)});
  EXPECT_FALSE(torch::equal(drawn[0], drawn[1]) && torch::equal(drawn[0], drawn[2])) << "the rest is sampled";
  EXPECT_TRUE(torch::equal(continued({.image = picture_, .top_rows = 8})[2], expected_)) << "every row kept";
}

TEST_F(ImagePrompt, AMaskKeepsTheCellsItMarksWhite) {
  auto mask = torch::zeros({3, 200, 200});  // scaled to the 8x8 grid: the left 3 token columns white
  mask.narrow(2, 0, 75).fill_(1.0);
  data::write_png(dir_ / "mask.png", mask);
  const auto kept = (torch::arange(64) % 8) < 3;
  const auto tokens = continued({.image = picture_, .mask = dir_ / "mask.png"});
  for (int64_t c = 0; c < tokens.size(0); ++c) {
    EXPECT_TRUE(torch::equal(tokens[c].masked_select(kept), expected_.masked_select(kept))) << c;
  }
  EXPECT_FALSE(torch::equal(tokens.masked_select(~kept), expected_.masked_select(~kept).repeat(tokens.size(0))))
      << "the other cells are drawn";
}

// A 16-bit prior is built in 16 bits, computes close to the float32 one, and the same seed
// draws mostly the same tokens.
TEST(PipelineDtype, A16BitPriorHoldsItsWeightsIn16BitsAndDrawsNearlyTheSameImages) {
  const auto config = demo_pipeline(4);
  auto reference = models::load_trained_prior(config.prior);
  torch::manual_seed(0);
  const auto tokens = torch::cat({torch::randint(0, 128, {2, 24}), torch::randint(0, 512, {2, 64})}, 1);
  torch::NoGradGuard no_grad;
  const auto expected = reference.model->forward(tokens);
  for (const auto dtype : {torch::kBFloat16, torch::kFloat16}) {
    auto trained = models::load_trained_prior(config.prior, dtype);
    for (const auto& p : trained.model->parameters()) ASSERT_EQ(p.scalar_type(), dtype);
    const double error = testing::relative_error(trained.model->forward(tokens).to(torch::kFloat32), expected);
    EXPECT_LT(error, 0.03) << c10::toString(dtype);
    std::printf("%s logits: relative error %.3g\n", c10::toString(dtype), error);
  }
  EXPECT_EQ(torch::get_default_dtype(), caffe2::TypeMeta::Make<float>()) << "the default is restored";

  auto in_bf16 = config;
  in_bf16.dtype = "bfloat16";
  const std::vector<std::string> prompts = {"a red bag on the left", "a blue sneaker at the top"};
  const auto full = Pipeline(config).generate(prompts), half = Pipeline(in_bf16).generate(prompts);
  double same = 0;
  for (size_t i = 0; i < full.size(); ++i) {
    same += (full[i].tokens == half[i].tokens).to(torch::kFloat64).mean().item<double>();
  }
  same /= static_cast<double>(full.size());
  EXPECT_GT(same, 0.7) << "the same uniforms, nearly the same probabilities";
  std::printf("bfloat16 pipeline: %.0f%% of the float32 pipeline's tokens\n", 100 * same);
}

// int8 weights on the CPU: the next token as float32 picks it, at teacher-forced positions of
// images the float32 pipeline draws, and the logits' largest difference; printed, and held to
// bounds that a broken product (or the float weights left in use) would cross.
TEST(PipelineDtype, AnInt8PriorPicksFloat32sNextTokenAndRefusesAGpu) {
  auto config = demo_pipeline(4);
  const std::vector<std::string> prompts = {"a red bag on the left", "a blue sneaker at the top",
                                            "a white trouser on the right", "a green ankle boot at the bottom"};
  const auto drawn = Pipeline(config).generate(prompts);
  auto reference = models::load_trained_prior(config.prior), quantized = models::load_trained_prior(config.prior);
  EXPECT_EQ(models::quantize_linears_int8(*quantized.model),
            2 * static_cast<int64_t>(quantized.model->resblocks().size()) + 1)
      << "two in each resblock and the logits' layer";
  const auto tokenizer = text::Tokenizer::load(config.tokenizer);
  std::vector<torch::Tensor> rows;
  for (const auto& image : drawn) {
    const auto caption = torch::tensor(tokenizer.encode(prompts[static_cast<size_t>(image.request)]).ids, torch::kInt64);
    rows.push_back(torch::cat({caption, image.tokens.flatten()}));
  }
  const auto text_length = reference.config.text_length, classes = reference.config.text_classes();
  torch::NoGradGuard no_grad;
  const auto logits_of = [&](models::Prior& prior) {
    return prior->forward(torch::stack(rows)).narrow(1, text_length - 1, 64).narrow(2, classes, 512);
  };
  const auto expected = logits_of(reference.model), got = logits_of(quantized.model);
  const double agreement = (expected.argmax(-1) == got.argmax(-1)).to(torch::kFloat64).mean().item<double>();
  const double largest = (expected - got).abs().max().item<double>();
  const double spread = (expected.amax(-1) - expected.amin(-1)).mean().item<double>();
  std::printf("int8 prior: next token as float32 at %.1f%% of %lld positions; logits differ by %.3g at most "
              "(their spread: %.3g)\n", 100 * agreement, static_cast<long long>(expected.numel() / 512), largest,
              spread);
  EXPECT_GT(agreement, 0.9);
  EXPECT_GT(largest, 0.0);
  EXPECT_LT(largest, 0.1 * spread);

  config.dtype = "int8";
  const auto images = Pipeline(config).generate(prompts);
  ASSERT_EQ(images.size(), drawn.size());
  EXPECT_EQ(images[0].image.sizes(), drawn[0].image.sizes());
  config.device = "cuda";
  EXPECT_THROW_WITH(Pipeline{config}, Error, "dtype int8 runs on the CPU");
}

// ruDALL-E's schedule: candidate c of N draws with stage c * S / N's filter, exactly as an
// unscheduled pipeline with that filter draws it, in any batch.
TEST(PipelineSchedule, EachCandidateDrawsWithItsStagesFilterInAnyBatch) {
  auto config = demo_pipeline(4);
  config.schedule = {.top_k = {1, 0, 8}, .top_p = {1.0, 1.0, 0.5}};
  config.batch_size = 3;
  const std::vector<std::string> prompts = {"a red bag on the left", "a blue sneaker at the top"};
  const auto scheduled = Pipeline(config).generate(prompts);
  ASSERT_EQ(scheduled.size(), 8u);
  const std::vector<std::pair<int64_t, double>> stage_of_candidate = {{1, 1.0}, {1, 1.0}, {0, 1.0}, {8, 0.5}};
  for (const auto& [top_k, top_p] : std::set(stage_of_candidate.begin(), stage_of_candidate.end())) {
    auto plain = demo_pipeline(4);
    plain.sampling.top_k = top_k;
    plain.sampling.top_p = top_p;
    const auto drawn = Pipeline(plain).generate(prompts);
    for (size_t i = 0; i < drawn.size(); ++i) {
      if (stage_of_candidate[static_cast<size_t>(drawn[i].candidate)] != std::pair{top_k, top_p}) continue;
      EXPECT_TRUE(torch::equal(scheduled[i].tokens, drawn[i].tokens)) << "image " << i << " of top_k " << top_k;
      EXPECT_EQ(scheduled[i].top_k, top_k);
      EXPECT_EQ(scheduled[i].top_p, top_p);
    }
  }
  // top_k 1 draws the likeliest code whatever the uniforms: candidates 0 and 1 agree, 2 does not.
  EXPECT_TRUE(torch::equal(scheduled[0].tokens, scheduled[1].tokens));
  EXPECT_FALSE(torch::equal(scheduled[0].tokens, scheduled[2].tokens));
  config.schedule.top_p.pop_back();
  EXPECT_THROW_WITH(Pipeline{config}, Error, "schedule.top_k has 3 stages, schedule.top_p 2");
}

// Requests of different seeds, filters, candidate counts and guidance in one generate call:
// each draws exactly what a pipeline configured with its settings draws for it alone, at
// its own stream index (dalle-serve batches requests so; dalle-generate is the reference).
TEST(PipelineRequests, EachRequestDrawsWhatAPipelineWithItsSettingsDraws) {
  auto base = demo_pipeline(2);
  base.batch_size = 3;  // batches that straddle requests
  Pipeline pipeline(base);
  const auto with_seed = pipeline.prepare("a red bag on the left", 0, [](PromptRequest& r) { r.sampling.seed = 11; });
  const auto filtered = pipeline.prepare("a blue sneaker at the top", 1, [](PromptRequest& r) {
    r.candidates = 3;
    r.sampling.top_k = 20;
  });
  const auto guided = pipeline.prepare("a red bag on the left", 0, [](PromptRequest& r) {
    r.sampling.guidance_scale = 2.0;  // another batch group: two model calls per token
    r.sampling.seed = 11;
  });
  const auto together = pipeline.generate({with_seed, guided, filtered});
  ASSERT_EQ(together.size(), 7u);
  const std::vector<int64_t> request_of_image = {0, 0, 1, 1, 2, 2, 2};
  for (size_t i = 0; i < together.size(); ++i) EXPECT_EQ(together[i].request, request_of_image[i]) << i;

  const auto alone = [&](const PreparedRequest& prepared, int64_t index) {
    const auto& request = prepared.request();
    auto config = prepared.settings();
    std::vector<std::string> prompts(static_cast<size_t>(index), "a green dress");  // prompts before it
    prompts.push_back(request.prompt);
    auto images = Pipeline(config).generate(prompts);
    images.erase(images.begin(), images.begin() + index * request.candidates);
    return images;
  };
  size_t at = 0;
  for (const auto& [prepared, index] : std::vector<std::pair<PreparedRequest, int64_t>>{
           {with_seed, 0}, {guided, 0}, {filtered, 1}}) {
    const auto& request = prepared.request();
    for (const auto& expected : alone(prepared, index)) {
      const auto& image = together.at(at++);
      EXPECT_TRUE(torch::equal(image.tokens, expected.tokens)) << request.prompt << " candidate " << image.candidate;
      EXPECT_EQ(image.seed, request.sampling.seed);
      EXPECT_EQ(image.prompt_index, index);
      EXPECT_EQ(image.top_k, request.sampling.top_k);
    }
  }
  EXPECT_THROW_WITH(pipeline.prepare("a red bag on the left", 0, [](PromptRequest& r) { r.keep = 1; }), Error,
                    "keeping 1 of 2 candidates needs a CLIP model");
  EXPECT_THROW_WITH(pipeline.prepare(" "), Error, "pipeline: the prompt is blank");
  EXPECT_THROW_WITH(pipeline.generate(std::vector<std::string>{"a red bag on the left", " "}), Error,
                    "pipeline: prompt 1: the prompt is blank");
  // generate takes only what its own pipeline prepared: nothing else was checked against it.
  EXPECT_THROW_WITH(Pipeline(base).generate({with_seed}), Error, "request 0 was not prepared by this pipeline");
  EXPECT_THROW_WITH(pipeline.generate({with_seed, PreparedRequest()}), Error, "request 1 was not prepared");
}

// An adapter file for the demo prior whose `targets` layers draw something else: its B drawn
// at random, as training would move it.
std::string demo_adapter(const testing::ScratchDir& dir, const std::string& name, const std::string& target,
                         uint64_t seed) {
  auto prior = models::load_trained_prior(demo_pipeline(1).prior);
  const models::AdapterConfig config{.rank = 2, .alpha = 2, .targets = {target}};
  models::add_adapters(*prior.model, config);
  torch::manual_seed(seed);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : prior.model->named_parameters()) {
      if (item.key().ends_with(".lora_B.weight")) item.value().normal_(0.0, 1.0);
    }
  }
  const auto path = dir / (name + ".safetensors");
  models::save_adapter_file(path, io::state_dict(*prior.model), config, "", "prior");
  return path;
}

// Requests choosing named adapters draw what a pipeline with those files in `adapters` draws,
// whatever they are batched with and in whatever order they name them; the base comes back
// for the requests that choose none.
TEST(PipelineAdapters, ARequestsAdaptersDrawWhatAPipelineFoldingThemAtLoadDraws) {
  testing::ScratchDir dir;
  const auto attention = demo_adapter(dir, "attention", "resblocks.*.qkv", 5);
  const auto mlp = demo_adapter(dir, "mlp", "resblocks.*.fc_*", 6);
  auto config = demo_pipeline(2);
  config.batch_size = 3;
  config.named_adapters = {"attention=" + attention, "mlp=" + mlp};
  Pipeline pipeline(config);
  const auto choosing = [&](std::vector<AdapterChoice> adapters) {
    return pipeline.prepare("a red bag on the left", 0, [&](PromptRequest& r) { r.adapters = adapters; });
  };
  const auto plain = choosing({});
  const auto both = choosing({{"mlp", 0.5}, {"attention", 1.0}});  // folded in named_adapters' order
  const auto one = choosing({{"attention", 1.0}});
  const auto zero = choosing({{"mlp", 0}});  // weight 0: the base, in the base's batches
  EXPECT_EQ(both.request().adapters, (std::vector<AdapterChoice>{{"attention", 1.0}, {"mlp", 0.5}}));
  EXPECT_EQ(both.settings().adapters, (std::vector<std::string>{attention + ":1", mlp + ":0.5"}));
  EXPECT_TRUE(both.settings().named_adapters.empty()) << "the sidecar's config draws the same by itself";
  EXPECT_TRUE(zero.request().adapters.empty());

  const auto together = pipeline.generate({plain, both, one, zero, plain});
  ASSERT_EQ(together.size(), 10u);
  std::vector<torch::Tensor> expected;
  for (const auto* prepared : {&plain, &both, &one, &zero, &plain}) {
    for (const auto& image : Pipeline(prepared->settings()).generate({"a red bag on the left"})) {
      expected.push_back(image.tokens);
    }
  }
  for (size_t i = 0; i < together.size(); ++i) {
    EXPECT_TRUE(torch::equal(together[i].tokens, expected[i])) << "image " << i << " of request "
                                                               << together[i].request;
  }
  // Both candidates of a request, so that one token flipped anywhere tells adapters apart: a single
  // 64-token draw of the trained demo prior can come out the same on another machine's arithmetic.
  const auto request_tokens = [&](size_t request) {
    return torch::cat({together[2 * request].tokens, together[2 * request + 1].tokens});
  };
  EXPECT_FALSE(torch::equal(request_tokens(0), request_tokens(2))) << "the attention adapter changes the draw";
  EXPECT_FALSE(torch::equal(request_tokens(1), request_tokens(2))) << "and mlp's on top of it";
  // Drawn alone after the adapted ones, the base draws the base's images again.
  EXPECT_TRUE(torch::equal(pipeline.generate({plain}).at(0).tokens, expected[0]));

  EXPECT_THROW_WITH(choosing({{"style", 1.0}}), Error, "no named adapter 'style'; it has attention, mlp");
  EXPECT_THROW_WITH(choosing({{"mlp", 1.0}, {"mlp", 2.0}}), Error, "mlp is chosen twice");
  EXPECT_THROW_WITH(choosing({{"mlp", std::nan("")}}), Error, "mlp's weight is not finite");
  EXPECT_THROW_WITH(Pipeline(demo_pipeline(1)).prepare("a bag", 0, [](PromptRequest& r) { r.adapters = {{"a", 1}}; }),
                    Error, "this pipeline has none (named_adapters)");
  config.named_adapters = {"attention=" + attention, "attention=" + mlp};
  EXPECT_THROW_WITH(Pipeline{config}, Error, "named_adapters names attention twice");
  config.named_adapters = {"=" + mlp};
  EXPECT_THROW_WITH(Pipeline{config}, Error, "expected NAME=FILE");
  config.named_adapters = {"mlp=" + mlp};
  config.dtype = "int8";
  EXPECT_THROW_WITH(Pipeline{config}, Error, "int8 weights cannot take");
}

// On a GPU the decoding step's graphs, captured once, read the weights each switch folds in
// place: requests alternating adapters draw what eager launches draw.
TEST(PipelineAdapters, OnAGpuGraphsReadTheWeightsEachSwitchFolds) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "torch sees no CUDA device";
  testing::ScratchDir dir;
  auto config = demo_pipeline(2);
  config.device = "cuda";
  config.named_adapters = {"attention=" + demo_adapter(dir, "attention", "resblocks.*.qkv", 5)};
  const auto tokens_of = [&](bool graphs) {
    config.cuda_graphs = graphs;
    Pipeline pipeline(config);
    std::vector<PreparedRequest> requests;
    for (const double weight : {0.0, 1.0, 0.0, 0.5}) {
      requests.push_back(pipeline.prepare("a red bag on the left", 0, [&](PromptRequest& r) {
        r.adapters = {{"attention", weight}};
      }));
    }
    std::vector<torch::Tensor> tokens;
    for (const auto& request : requests) tokens.push_back(pipeline.generate({request}).at(0).tokens);
    return tokens;
  };
  const auto replayed = tokens_of(true), launched = tokens_of(false);
  for (size_t i = 0; i < replayed.size(); ++i) EXPECT_TRUE(torch::equal(replayed[i], launched[i])) << "request " << i;
  EXPECT_TRUE(torch::equal(replayed[0], replayed[2])) << "the base again after the adapter";
  EXPECT_FALSE(torch::equal(replayed[0], replayed[1])) << "the adapter is read";
}

// pipeline.h's thread rule: prepare, image_size, image_tokens and config, called from several
// threads while generate draws on another, give what they give alone, and the draw is the one
// drawn alone (dalle-serve prepares on its event loop while its worker generates).
TEST(PipelineThreads, PrepareAndTheSizesAnswerFromAnyThreadWhileGenerateDraws) {
  using namespace std::chrono_literals;
  Pipeline pipeline(demo_pipeline(2));
  const auto drawn = pipeline.prepare("a red bag on the left", 0, [](PromptRequest& r) {
    r.candidates = 3;
    r.preview_every = 8;
  });
  const auto alone = pipeline.generate({drawn});
  const auto settings_of = [](int64_t reader) {
    return [reader](PromptRequest& r) {
      r.sampling.seed = 100 + reader;
      r.candidates = 1 + reader;
    };
  };
  const auto size = pipeline.image_size(false), tokens = pipeline.image_tokens();
  const auto batch_size = pipeline.config().batch_size;
  auto expected = pipeline.prepare("a blue sneaker at the top", 1, settings_of(0)).settings();
  const auto expected_yaml = config_to_yaml(visit_of(expected));

  constexpr int64_t kReaders = 4;
  std::atomic<bool> generating{false}, finished{false};
  std::atomic<int64_t> calls_while_generating{0}, wrong{0};
  std::vector<int64_t> calls_at_preview;
  auto generation = std::async(std::launch::async, [&] {
    auto images = pipeline.generate({drawn}, [&](const std::vector<Preview>&) {
      if (!generating.exchange(true)) {
        // The readers have called at least once each before the draw goes on (at most 30 s).
        for (const auto give_up = std::chrono::steady_clock::now() + 30s;
             calls_while_generating < kReaders && std::chrono::steady_clock::now() < give_up;) {
          std::this_thread::sleep_for(1ms);
        }
      }
      calls_at_preview.push_back(calls_while_generating);
    });
    finished = true;
    return images;
  });
  std::vector<std::future<void>> readers;
  for (int64_t reader = 0; reader < kReaders; ++reader) {
    readers.push_back(std::async(std::launch::async, [&, reader] {
      while (!finished) {
        const auto prepared = pipeline.prepare("a blue sneaker at the top", 1, settings_of(reader));
        const auto& request = prepared.request();
        auto settings = prepared.settings();
        settings.candidates = expected.candidates;
        settings.sampling.seed = expected.sampling.seed;
        const bool right = request.prompt == "a blue sneaker at the top" && request.stream_index == 1 &&
                           request.candidates == 1 + reader && request.sampling.seed == 100 + reader &&
                           prepared.settings().candidates == 1 + reader &&
                           config_to_yaml(visit_of(settings)) == expected_yaml &&
                           pipeline.image_size(false) == size && pipeline.image_tokens() == tokens &&
                           pipeline.config().batch_size == batch_size;
        bool refused = false;
        try {
          pipeline.prepare(" ");
        } catch (const Error& error) {
          refused = std::string(error.what()) == "pipeline: the prompt is blank";
        }
        if (!right || !refused) ++wrong;
        if (generating && !finished) ++calls_while_generating;
      }
    }));
  }
  ASSERT_EQ(generation.wait_for(300s), std::future_status::ready) << "generate did not end";
  for (auto& reader : readers) ASSERT_EQ(reader.wait_for(30s), std::future_status::ready) << "a reader hung";
  const auto together = generation.get();
  EXPECT_EQ(wrong, 0) << "an answer from another thread differed from the one given alone";
  ASSERT_GE(calls_at_preview.size(), 2u);
  EXPECT_GE(calls_at_preview.front(), kReaders) << "the readers called while generate ran";
  EXPECT_GT(calls_at_preview.back(), calls_at_preview.front()) << "and went on calling while it drew";
  ASSERT_EQ(together.size(), alone.size());
  for (size_t i = 0; i < alone.size(); ++i) {
    EXPECT_TRUE(torch::equal(together[i].tokens, alone[i].tokens)) << "the same draw, image " << i;
  }
}

// A request may skip super-resolution; every written PNG carries its sidecar's JSON.
TEST(PipelineRequests, SuperResolutionPerRequestAndSettingsInThePng) {
  auto config = demo_pipeline(1);
  config.superres = std::string(DALLE_SOURCE_DIR) + "/models/fashion-compose-f8/superres";
  Pipeline pipeline(config);
  EXPECT_EQ(pipeline.image_size(false), 64);
  EXPECT_EQ(pipeline.image_size(true), 128);
  const auto small = pipeline.prepare("a red bag on the left", 0, [](PromptRequest& r) {
    r.superres = false;
    r.sampling.seed = 4;
  });
  const auto images = pipeline.generate({pipeline.prepare("a red bag on the left"), small});
  ASSERT_EQ(images.size(), 2u);
  EXPECT_EQ(images[0].image.size(2), 128);
  EXPECT_EQ(images[1].image.size(2), 64);
  EXPECT_EQ(small.settings().superres, "");

  const auto png = encode_generated_png(small.settings(), images[1]);
  const auto text = data::png_text(png, kPngTextKeyword);
  ASSERT_TRUE(text.has_value());
  EXPECT_EQ(*text, image_metadata(small.settings(), images[1]));
  EXPECT_NE(text->find("\"seed\": 4"), std::string::npos) << *text;
  EXPECT_TRUE(torch::allclose(data::decode_image(png, "png"), images[1].image, 0, 1.0 / 255));

  testing::ScratchDir dir;
  write_generation(dir / "out", pipeline.config(), {images[0]});
  EXPECT_EQ(data::png_text(testing::read_text(dir / "out/0000-00.png"), kPngTextKeyword),
            testing::read_text(dir / "out/0000-00.json"));
}

// A random prior of ruDALL-E's layout at a tiny size, reading the YouTokenToMe fixture's ids
// (600 of them, 32 per caption) and drawing for the demo's VQGAN.
std::string random_rudalle_prior(const testing::ScratchDir& dir) {
  const std::string vqgan = std::string(DALLE_SOURCE_DIR) + "/models/fashion-compose-f8/vqgan";
  const std::string yaml =
      "kind: prior\nmodel: {text_length: 32, text_vocab_size: 600, grid_size: 8, image_vocab_size: 512, layers: 2,\n"
      "        width: 32, heads: 2, layer_pattern: rudalle, sandwich_norm: true, head_norm: true, gelu: tanh}\n"
      "tokenizer: " + testing::fixture_path("yttm_bpe.model") + "\nimage_tokenizer: " + vqgan + "\n";
  torch::manual_seed(0);
  const models::Prior prior(models::PriorConfig{.text_length = 32, .text_vocab_size = 600, .grid_size = 8,
                                                .image_vocab_size = 512, .layers = 2, .width = 32, .heads = 2,
                                                .layer_pattern = "rudalle", .sandwich_norm = true, .head_norm = true,
                                                .gelu = "tanh"});
  io::save_checkpoint(dir / "prior", {.config_yaml = yaml, .weights = io::state_dict(*prior)});
  return dir / "prior";
}

// Prompts reach a ruDALL-E prior through its own tokenizer, lower-cased as rudalle does.
TEST(PipelinePreviews, ShowTheRowsDrawnSoFarAndTheLastIsTheImageWithoutChangingAnyDraw) {
  Pipeline pipeline(demo_pipeline(2));
  const auto previewed_with = [&](int64_t every, int64_t candidates) {
    return pipeline.prepare("a red bag on the left", 0, [&](PromptRequest& r) {
      r.preview_every = every;
      r.preview_candidates = candidates;
    });
  };
  const auto previewed = previewed_with(24, 0), plain = pipeline.prepare("a blue sneaker at the top", 1);
  std::vector<Preview> shown;
  const auto images = pipeline.generate({previewed, plain}, [&](const std::vector<Preview>& previews) {
    shown.insert(shown.end(), previews.begin(), previews.end());
  });
  // 64 positions: after 24 and 48, then the last; only the request that asked, both candidates.
  ASSERT_EQ(shown.size(), 6u);
  for (size_t i = 0; i < shown.size(); ++i) {
    EXPECT_EQ(shown[i].request, 0);
    EXPECT_EQ(shown[i].candidate, static_cast<int64_t>(i % 2));
    EXPECT_EQ(shown[i].drawn, std::vector<int64_t>({24, 48, 64})[i / 2]);
    EXPECT_EQ(shown[i].total, 64);
  }
  // After 24 positions: three rows of tokens, then none; three rows of 8 pixels, then white.
  const auto& early = shown[0];
  const auto& final_image = images.at(0);
  ASSERT_EQ(final_image.request, 0);
  EXPECT_TRUE(torch::equal(early.tokens.flatten().narrow(0, 0, 24), final_image.tokens.flatten().narrow(0, 0, 24)));
  EXPECT_EQ(early.tokens.flatten().narrow(0, 24, 40).count_nonzero().item<int64_t>(), 0);
  EXPECT_TRUE(torch::all(early.image.narrow(1, 24, 40) == 1).item<bool>()) << "not drawn yet: blank";
  EXPECT_FALSE(torch::all(early.image.narrow(1, 0, 24) == 1).item<bool>());
  for (int64_t candidate = 0; candidate < 2; ++candidate) {
    const auto& last = shown[4 + static_cast<size_t>(candidate)];
    const auto& image = images.at(static_cast<size_t>(candidate));
    EXPECT_TRUE(torch::equal(last.tokens, image.tokens)) << "the last preview is the image's tokens";
    EXPECT_TRUE(torch::equal(last.image, image.image)) << "and its pixels";
  }
  const auto unpreviewed = pipeline.generate({pipeline.prepare("a red bag on the left"), plain});
  ASSERT_EQ(unpreviewed.size(), images.size());
  for (size_t i = 0; i < images.size(); ++i) {
    EXPECT_TRUE(torch::equal(unpreviewed[i].tokens, images[i].tokens)) << "previews change no draw: image " << i;
  }
  const auto first_only = previewed_with(24, 1);
  std::vector<Preview> of_first;
  const auto again = pipeline.generate({first_only, plain}, [&](const std::vector<Preview>& previews) {
    of_first.insert(of_first.end(), previews.begin(), previews.end());
  });
  ASSERT_EQ(of_first.size(), 3u) << "after 24 and 48, then the last, of candidate 0 alone";
  for (size_t i = 0; i < of_first.size(); ++i) {
    EXPECT_EQ(of_first[i].candidate, 0);
    EXPECT_TRUE(torch::equal(of_first[i].tokens, shown[2 * i].tokens)) << "the same preview as when all are shown";
    EXPECT_TRUE(torch::allclose(of_first[i].image, shown[2 * i].image, 0.0, 1e-5));
  }
  EXPECT_TRUE(torch::equal(again.at(1).tokens, images.at(1).tokens));
  EXPECT_THROW_WITH(previewed_with(24, -2), Error, "preview_candidates is -2");
  EXPECT_THROW_WITH(previewed_with(-1, 0), Error, "preview_every is -1");
}

TEST(PipelineYttm, RudallesTokenizerFeedsThePrior) {
  testing::ScratchDir dir;
  PipelineConfig config{.prior = random_rudalle_prior(dir), .candidates = 2, .threads = 2};
  Pipeline pipeline(config);
  // Each prompt first, so that each draws from the same sampling streams.
  const auto drawn = [&](const std::string& prompt) { return pipeline.generate({prompt}).at(1).tokens; };
  const auto upper = drawn("Красная сумка СЛЕВА");
  EXPECT_TRUE(torch::equal(upper, drawn("  красная сумка слева"))) << "the same caption once lower-cased and stripped";
  EXPECT_FALSE(torch::equal(upper, drawn("синие кроссовки"))) << "another caption, other tokens";

  config.tokenizer = std::string(DALLE_SOURCE_DIR) + "/models/fashion-compose-f8/tokenizer.model";
  EXPECT_NO_THROW(Pipeline{config}) << "a SentencePiece model is still read as one";
  config.tokenizer.clear();
  config.clip = std::string(DALLE_SOURCE_DIR) + "/models/fashion-compose-f8/clip";
  EXPECT_THROW_WITH(Pipeline{config}, Error, "cannot read ruDALL-E's caption ids");
  auto demo = demo_pipeline(1);
  demo.tokenizer = testing::fixture_path("yttm_bpe.model");
  EXPECT_THROW_WITH(Pipeline{demo}, Error, "600 ids, more than the prior's text_vocab_size 128");
}

// ruCLIP reranks a ruDALL-E prior's candidates (rudalle's cherry_pick_by_ruclip): the ruCLIP
// parity fixture's model (tests/parity/make_ruclip_fixture.py) reads its own YouTokenToMe
// ids of the prompt in each of ruclip Predictor's templates, their features averaged.
TEST(PipelineYttm, RuclipRanksByThePromptInItsTemplates) {
  testing::ScratchDir dir;
  const auto fixture = io::read_safetensors(testing::fixture_path("ruclip_parity.safetensors"));
  const std::string clip_yaml =
      "kind: clip\nmodel: {embed_dim: 16, image_size: 32, patch_size: 8, vision_width: 64, vision_layers: 2,\n"
      "        vision_heads: 1, context_length: 16, vocab_size: 600, text_width: 32, text_layers: 2, text_heads: 4,\n"
      "        activation: quick_gelu, text_pooling: eos, eos_id: 3, preprocess: ruclip}\n";
  const auto weights = testing::dequantized_weights(fixture.tensors);
  io::save_checkpoint(dir / "ruclip", {.config_yaml = clip_yaml, .weights = weights});
  const auto templates = nlohmann::json::parse(fixture.metadata.at("templates")).get<std::vector<std::string>>();
  const std::string bpe = testing::fixture_path("yttm_bpe.model");
  PipelineConfig config{.prior = random_rudalle_prior(dir), .clip = dir / "ruclip", .clip_tokenizer = bpe,
                        .clip_templates = templates, .candidates = 4, .keep = 4, .threads = 2};
  const std::string prompt = "  Красная СУМКА слева";
  const auto ranked = Pipeline(config).generate({prompt});
  ASSERT_EQ(ranked.size(), 4u);
  // The scores are CLIP's for the mean of the templates' features, best first.
  auto clip = models::load_trained_clip(dir / "ruclip");
  const auto bpe_model = text::YttmTokenizer::load(bpe);
  std::vector<torch::Tensor> images, renderings;
  for (const auto& image : ranked) images.push_back(image.image);
  for (const auto& templ : templates) {
    renderings.push_back(torch::tensor(bpe_model.ruclip_ids(text::fill_clip_template(templ, prompt), 16)));
  }
  const auto expected = models::clip_scores(clip, torch::stack(images), torch::stack(renderings));
  for (size_t rank = 0; rank < ranked.size(); ++rank) {
    EXPECT_EQ(ranked[rank].rank, static_cast<int64_t>(rank));
    ASSERT_TRUE(ranked[rank].clip_score.has_value());
    EXPECT_NEAR(*ranked[rank].clip_score, expected[static_cast<int64_t>(rank)].item<double>(), 1e-4) << rank;
    if (rank > 0) {
      EXPECT_GE(*ranked[rank - 1].clip_score, *ranked[rank].clip_score);
    }
  }
  // Without templates CLIP reads the prompt alone, and scores the same images otherwise.
  config.clip_templates.clear();
  const auto plain = Pipeline(config).generate({prompt});
  std::set<double> with_templates, alone;
  for (size_t i = 0; i < ranked.size(); ++i) {
    with_templates.insert(*ranked[i].clip_score);
    alone.insert(*plain[i].clip_score);
  }
  EXPECT_NE(with_templates, alone);

  // What does not fit is refused before anything is drawn.
  config.clip_templates = {"фото {}"};
  config.clip_tokenizer.clear();
  EXPECT_THROW_WITH(Pipeline{config}, Error, "clip_templates are read by the CLIP's own tokenizer");
  config.clip_tokenizer = bpe;
  config.clip_templates = {"фото"};
  EXPECT_THROW_WITH(Pipeline{config}, Error, "clip_templates: CLIP template 'фото' must hold {} once");
  config.clip_templates.clear();
  const auto argmax_yaml = std::regex_replace(clip_yaml, std::regex("text_pooling: eos"), "text_pooling: argmax");
  io::save_checkpoint(dir / "argmax", {.config_yaml = argmax_yaml, .weights = weights});
  config.clip = dir / "argmax";
  EXPECT_THROW_WITH(Pipeline{config}, Error, "the YouTokenToMe CLIP tokenizer", "(600 ids, end of text 3) does not fit",
                    "argmax pooling");
}

TEST_F(ImagePrompt, HalfGivenOrImpossiblePromptsAreRefused) {
  EXPECT_THROW_WITH(continued({.top_rows = 2}), Error, "set the image");
  EXPECT_THROW_WITH(continued({.image = picture_}), Error, "with top_rows or with mask");
  EXPECT_THROW_WITH(continued({.image = picture_, .top_rows = 2, .mask = picture_}), Error, "one of them");
  EXPECT_THROW_WITH(continued({.image = picture_, .top_rows = 9}), Error, "exceeds the token grid's 8 rows");
  EXPECT_THROW_WITH(continued({.image = dir_ / "absent.png", .top_rows = 2}), Error, "absent.png");
  data::write_png(dir_ / "black.png", torch::zeros({3, 8, 8}));
  EXPECT_THROW_WITH(continued({.image = picture_, .mask = dir_ / "black.png"}), Error, "keeps no token");
}

// dalle-serve's edits: a request's own image prompt (pixels and rows) draws what the config's
// image prompt draws, batched with requests without one in the same call.
TEST_F(ImagePrompt, ARequestsOwnImagePromptDrawsWhatTheConfigsDrawsBesideRequestsWithout) {
  const auto from_config = continued({.image = picture_, .top_rows = 3});
  Pipeline pipeline(demo_pipeline(4));
  const auto own_prompt = [&](int64_t top_rows) {
    return pipeline.prepare("a blue sneaker at the top", 0, [&](PromptRequest& r) {
      r.image_prompt = std::make_shared<const PromptImage>(
          PromptImage{.image = data::read_image(picture_), .top_rows = top_rows});
    });
  };
  const auto own = own_prompt(3);
  const auto plain = pipeline.prepare("a red bag on the left", 1);
  const auto images = pipeline.generate({plain, own});
  ASSERT_EQ(images.size(), 8u);
  for (int64_t c = 0; c < 4; ++c) {
    EXPECT_TRUE(torch::equal(images[static_cast<size_t>(4 + c)].tokens.flatten(), from_config[c])) << c;
  }
  const auto alone = pipeline.generate({plain});
  for (size_t c = 0; c < 4; ++c) EXPECT_TRUE(torch::equal(images[c].tokens, alone[c].tokens)) << "untouched " << c;
  EXPECT_EQ(own.settings().image_prompt.top_rows, 3);

  EXPECT_THROW_WITH(own_prompt(8), Error, "the 8-row grid takes 1 to 7");
}

// `encoder` encodes image prompts in the decoder's place. Here the demo's VQGAN reading its
// pixels in [0, 1] as they are (pixel_range zero_to_one): the same codes and grid, other
// tokens of the picture, which the samples keep. One of another grid is refused by name.
TEST_F(ImagePrompt, TheEncoderKeyEncodesPromptsInTheDecodersPlace) {
  using torch::indexing::Slice;
  namespace fs = std::filesystem;
  const auto encoder = dir_ / "encoder";
  fs::copy(std::string(DALLE_SOURCE_DIR) + "/models/fashion-compose-f8/vqgan", encoder, fs::copy_options::recursive);
  auto yaml = testing::read_text(encoder + "/config.yaml");
  const std::string quantizer = "  quantizer: \"gumbel\"\n";
  ASSERT_NE(yaml.find(quantizer), std::string::npos);
  yaml.replace(yaml.find(quantizer), quantizer.size(), quantizer + "  pixel_range: \"zero_to_one\"\n");
  testing::write_text(encoder + "/config.yaml", yaml);
  const auto encoded = demo_tokens(picture_, encoder);
  ASSERT_FALSE(torch::equal(encoded.index({Slice(0, 24)}), expected_.index({Slice(0, 24)})))
      << "the test needs an encoder whose tokens are not the decoder's";
  auto config = demo_pipeline(4);
  config.image_prompt = {.image = picture_, .top_rows = 3};
  config.encoder = encoder;
  Pipeline pipeline(config);
  for (const auto& image : pipeline.generate({"a blue sneaker at the top"})) {
    EXPECT_TRUE(torch::equal(image.tokens.flatten().index({Slice(0, 24)}), encoded.index({Slice(0, 24)})))
        << image.candidate;
  }
  const auto own = pipeline.prepare("a blue sneaker at the top", 0, [&](PromptRequest& r) {
    r.image_prompt =
        std::make_shared<const PromptImage>(PromptImage{.image = data::read_image(picture_), .top_rows = 2});
  });
  for (const auto& image : pipeline.generate({own})) {
    EXPECT_TRUE(torch::equal(image.tokens.flatten().index({Slice(0, 16)}), encoded.index({Slice(0, 16)})))
        << "a request's own prompt too, candidate " << image.candidate;
  }
  config.encoder = std::string(DALLE_SOURCE_DIR) + "/models/fashion-compose/vqgan";  // f4: 16 x 16 at 64 pixels
  EXPECT_THROW_WITH(Pipeline{config}, Error, "the encoder", "makes 16x16 token grids, the prior samples 8x8");
}

TEST(ImagePromptMask, TheOpaqueTopRowsAreKeptAndOtherShapesAreNot) {
  // 80 pixels square, scaled to a 64-pixel image of an 8x8 grid: 10 mask pixels a token row.
  const auto mask = [](int64_t opaque_from, int64_t opaque_to) {
    auto alpha = torch::zeros({1, 80, 80});
    alpha.narrow(1, opaque_from, opaque_to - opaque_from).fill_(1.0);
    return alpha;
  };
  EXPECT_EQ(top_rows_kept(mask(0, 30), 64, 8), 3);
  EXPECT_EQ(top_rows_kept(mask(0, 34), 64, 8), 3) << "a cell less than half opaque is drawn";
  EXPECT_EQ(top_rows_kept(mask(0, 36), 64, 8), 4) << "one at least half opaque is kept";
  EXPECT_FALSE(top_rows_kept(mask(30, 60), 64, 8)) << "a band below the top";
  EXPECT_FALSE(top_rows_kept(mask(0, 80), 64, 8)) << "nothing left to draw";
  EXPECT_FALSE(top_rows_kept(mask(0, 0), 64, 8)) << "nothing kept";
  auto hole = mask(0, 80);
  hole.narrow(1, 30, 20).narrow(2, 30, 20).fill_(0.0);
  EXPECT_FALSE(top_rows_kept(hole, 64, 8)) << "a hole in the middle";
  auto wide = torch::zeros({1, 80, 160});  // centre-cropped to its middle 80 columns, as the image is
  wide.narrow(1, 0, 20).fill_(1.0);
  wide.narrow(2, 0, 40).fill_(1.0);  // opaque left of the crop: cut away
  EXPECT_EQ(top_rows_kept(wide, 64, 8), 2);
}

}  // namespace
}  // namespace dalle::generate
