#include "dalle/train/trainers/dvae_trainer.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "dalle/models/trained.h"
#include "dalle/data/caption_dataset.h"
#include "dalle/data/fashion_compose.h"
#include "dalle/data/image.h"
#include "dalle/text/tokenizer.h"
#include "dalle/generate/encode_images.h"
#include "gpu_run.h"
#include "trainer_harness.h"
#include "test_support.h"

namespace dalle::train {
namespace {

using testing::ScratchDir;
using testing::training_lines;

class DvaeTrainerTest : public testing::TrainerSuite {
 protected:
  static void SetUpTestSuite() {
    compose_data(48, 8);
  }

  static DvaeTrainConfig tiny(int64_t steps) {
    DvaeTrainConfig config;
    config.model = {.hidden = 8, .decoder_init = 8, .groups = 2, .blocks_per_group = 1, .downsamplings = 1,
                    .vocab_size = 32};
    config.data.train = *data_ / "fc/train";
    config.data.validation = *data_ / "fc/test";
    config.data.image_size = 16;
    config.data.batch_size = 8;
    config.learning_rate = {.start = 3e-3, .end = 3e-3, .steps = 0};
    config.temperature = {.start = 1.0, .end = 0.5, .steps = 20};
    config.kl_weight = {.start = 0.0, .end = 1.0, .steps = 20};
    config.run = testing::quick_run(steps);
    config.grid_images = 2;
    config.optimizer.ema_decay = 0.8;
    return config;
  }
};

TEST_F(DvaeTrainerTest, ResumedRunContinuesWithTheSameLosses) {
  ScratchDir runs;
  testing::expect_exact_resume<DvaeTrainer>(tiny(8), runs);
  EXPECT_TRUE(std::filesystem::exists(runs / "whole/samples/step-000000008.png"));
  EXPECT_TRUE(std::filesystem::exists(runs / "whole/config.yaml"));
}

TEST_F(DvaeTrainerTest, LossGoesDownAndValidationReportsUsage) {
  testing::LearningRun<DvaeTrainer> run(tiny(60));
  const double first = testing::mean_metric(run.lines, "reconstruction", 1, 5);
  const double last = testing::mean_metric(run.lines, "reconstruction", 56, 60);
  EXPECT_LT(last, first - 0.2) << "reconstruction loss " << first << " -> " << last;
  const auto validation = run.trainer.validate();
  EXPECT_GT(validation.psnr, run.untrained.psnr + 1.0) << "PSNR of argmax reconstructions, EMA weights";
  EXPECT_GT(validation.perplexity, 1.0);
  EXPECT_GT(validation.decoder_sensitivity, 0.0) << "the decoder reads its codes";
  EXPECT_GT(validation.codes_used, 0.0);
  EXPECT_LE(validation.codes_used, 1.0);
}

TEST_F(DvaeTrainerTest, Fp16AndBf16RunsFollowTheFp32Run) {
  ScratchDir runs;
  auto reconstruction_after = [&](const std::string& mode) {
    auto config = tiny(12);
    config.precision.mode = mode;
    config.run.checkpoint_every = 1000;
    DvaeTrainer(config, runs / mode).run();
    return training_lines(runs / mode).at(12);
  };
  const auto fp32 = reconstruction_after("float32");
  const auto fp16 = reconstruction_after("float16");
  const auto bf16 = reconstruction_after("bfloat16");
  const double expected = fp32["reconstruction"].get<double>();
  EXPECT_NEAR(fp16["reconstruction"].get<double>(), expected, 0.03 * std::abs(expected));
  EXPECT_NEAR(bf16["reconstruction"].get<double>(), expected, 0.05 * std::abs(expected));
  EXPECT_EQ(fp16["skipped_updates"].get<int64_t>(), 0);
  EXPECT_GT(fp16["grad_scale"].get<double>(), 8192.0) << "the scale grows after finite updates";
  EXPECT_FALSE(fp32.contains("grad_scale"));
}

TEST_F(DvaeTrainerTest, EncodeImagesWritesTheDvaeTokensAndCaptionIds) {
  ScratchDir dir;
  DvaeTrainer(tiny(2), dir / "dvae").run();
  testing::train_caption_tokenizer(*data_ / "fc/test", dir / "tok.model", 60, 24);

  const auto info = generate::encode_images({.dataset = *data_ / "fc/test", .image_tokenizer = dir / "dvae",
                                   .tokenizer = dir / "tok.model", .out = dir / "tokens", .batch_size = 3,
                                   .images_per_shard = 5});
  EXPECT_EQ(info.images, 8);
  EXPECT_EQ(info.shards, 2);
  EXPECT_EQ(info.grid_height, 8);

  auto dvae = models::load_trained_dvae(dir / "dvae");
  const auto images = data::ImageCaptionDataset::open(*data_ / "fc/test");
  const auto tokenizer = text::Tokenizer::load(dir / "tok.model");
  const auto tokens = data::TokenDataset::open(dir / "tokens");
  ASSERT_EQ(tokens->size(), 8u);
  std::mt19937_64 rng(0);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < tokens->size(); ++i) {
    const auto example = tokens->get(i, rng);
    const auto source = images->get(i, rng);
    EXPECT_EQ(example->caption, images->record(i).captions[0]);
    EXPECT_TRUE(torch::equal(example->text_tokens, torch::tensor(tokenizer.encode(example->caption).ids)));
    const auto resized = data::resize(source->image, 16, 16).unsqueeze(0);
    EXPECT_EQ(example->image_tokens.sizes(), (std::vector<int64_t>{8, 8}));
    EXPECT_TRUE(torch::equal(example->image_tokens, dvae.model->encode_tokens(resized)[0])) << i;
  }
}

TEST_F(DvaeTrainerTest, ResumeRefusesAChangedRecipeAndLeavesTheRunAlone) {
  ScratchDir runs;
  DvaeTrainer(tiny(3), runs / "run").run();
  const std::string config_before = testing::read_text(runs / "run/config.yaml");
  auto changed = tiny(6);
  changed.data.batch_size = 4;
  changed.run.seed = 5;
  EXPECT_THROW_WITH(DvaeTrainer(changed, runs / "run"), Error, "different config", "data.batch_size (8 -> 4)",
                    "seed (0 -> 5)");
  EXPECT_EQ(testing::read_text(runs / "run/config.yaml"), config_before);
  auto longer = tiny(6);
  longer.run.checkpoint_every = 2;
  EXPECT_EQ(DvaeTrainer(longer, runs / "run").step(), 3) << "how long and how often may change";
}

TEST_F(DvaeTrainerTest, BadSettingsAreRefused) {
  ScratchDir runs;
  testing::write_text(runs / "notes.txt", "a user's file");
  EXPECT_THROW_WITH(DvaeTrainer(tiny(1), runs.path().string()), Error, "not a dVAE run directory");
  EXPECT_EQ(testing::read_text(runs / "notes.txt"), "a user's file");
  auto cold = tiny(1);
  cold.temperature.end = 0.0;
  EXPECT_THROW_WITH(DvaeTrainer(cold, runs / "c"), Error, "temperature.start and temperature.end must be positive");
  auto config = tiny(1);
  config.data.image_size = 15;
  EXPECT_THROW_WITH(DvaeTrainer(config, runs / "a"), Error, "multiple of 2^model.downsamplings");
  config = tiny(1);
  config.data.train = "";
  EXPECT_THROW_WITH(DvaeTrainer(config, runs / "b"), Error, "data.train and data.validation");
}

// The gumbel noise comes from the GPU's own generator, so the losses differ from the CPU's:
// the GPU run is held to the same update count and finite losses, resumed too.
TEST_F(DvaeTrainerTest, AGpuRunTrainsAndResumesWithFiniteLosses) {
  testing::expect_gpu_run_follows_cpu_run<DvaeTrainer>(tiny(6), "loss", std::nullopt);
}

TEST_F(DvaeTrainerTest, ACudaDeviceWithoutAGpuIsRefusedBeforeAnythingIsWritten) {
  testing::expect_cuda_refused_without_a_gpu<DvaeTrainer>(tiny(1), "dvae training");
}

}  // namespace
}  // namespace dalle::train

namespace dalle::train {
namespace {

TEST(DecoderSensitivity, ZeroExactlyWhenTheDecoderIgnoresItsCodes) {
  const models::DvaeConfig config{
      .hidden = 8, .decoder_init = 8, .groups = 2, .blocks_per_group = 1, .downsamplings = 1, .vocab_size = 16};
  torch::manual_seed(0);
  models::Dvae dvae(config);
  const auto tokens = torch::randint(0, 16, {4, 4, 4});
  EXPECT_GT(decoder_sensitivity(*dvae, tokens), 1e-4);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : dvae->named_parameters()) {
      if (item.key().starts_with("decoder.blocks.input.")) item.value().zero_();
    }
  }
  EXPECT_EQ(decoder_sensitivity(*dvae, tokens), 0.0);
  EXPECT_THROW(decoder_sensitivity(*dvae, tokens.slice(0, 0, 1)), Error);
}

}  // namespace
}  // namespace dalle::train
