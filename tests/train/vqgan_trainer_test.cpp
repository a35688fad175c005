#include "dalle/train/trainers/vqgan_trainer.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <random>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/fashion_compose.h"
#include "dalle/data/image.h"
#include "dalle/data/token_dataset.h"
#include "dalle/text/tokenizer.h"
#include "dalle/generate/encode_images.h"
#include "dalle/models/trained.h"
#include "gpu_run.h"
#include "test_support.h"
#include "trainer_harness.h"
#include "tiny_vqgan.h"

namespace dalle::train {
namespace {

using testing::ScratchDir;
using testing::training_lines;

class VqganTrainerTest : public testing::TrainerSuite {
 protected:
  static void SetUpTestSuite() {
    compose_data(48, 8);
  }

  static VqganTrainConfig tiny(int64_t steps, const std::string& quantizer = "gumbel") {
    return testing::tiny_vqgan_config(*data_ / "fc/train", *data_ / "fc/test", steps, quantizer);
  }

  static VqganTrainConfig with_discriminator(VqganTrainConfig config, int64_t start) {
    config.discriminator.enabled = true;
    config.discriminator.start = start;
    config.discriminator.channels = 8;
    config.discriminator.layers = 2;
    return config;
  }
};

TEST_F(VqganTrainerTest, ResumedGumbelRunWithADiscriminatorContinuesWithTheSameLosses) {
  // The discriminator starts at update 2, so the checkpoint at 3 carries its weights,
  // BatchNorm statistics and moments.
  testing::expect_exact_resume<VqganTrainer>(with_discriminator(tiny(8), 2));
}

TEST_F(VqganTrainerTest, ResumedFp16RunWithADiscriminatorContinuesWithTheSameLossesAndScales) {
  auto config = with_discriminator(tiny(8), 2);
  config.precision.mode = "float16";
  config.precision.adam_moments = "bfloat16";
  testing::expect_exact_resume<VqganTrainer>(config);
}

TEST_F(VqganTrainerTest, ResumedVectorRunWithRestartsContinuesWithTheSameLosses) {
  auto config = tiny(8, "vector");
  config.restart_every = 2;  // a usage window open across the checkpoint at 3
  testing::expect_exact_resume<VqganTrainer>(config);
}

TEST_F(VqganTrainerTest, VectorRunLearnsAndRestartsUnusedCodes) {
  auto config = tiny(30, "vector");
  config.restart_every = 10;
  testing::LearningRun<VqganTrainer> run(config);
  const double first = testing::mean_metric(run.lines, "reconstruction", 1, 5);
  const double last = testing::mean_metric(run.lines, "reconstruction", 26, 30);
  EXPECT_LT(last, 0.7 * first) << "L1 reconstruction " << first << " -> " << last;
  EXPECT_GT(run.lines.at(10)["restarted"].get<int64_t>(), 0) << "32 codes, few used by a fresh encoder";
  EXPECT_EQ(run.lines.at(9)["restarted"].get<int64_t>(), 0) << "restarts happen only every restart_every updates";
  const auto validation = run.trainer.validate();
  EXPECT_GT(validation.psnr, run.untrained.psnr + 1.0);
  EXPECT_GT(validation.codes_used, 1.0 / 32);
  EXPECT_LE(validation.codes_used, 1.0);
}

TEST_F(VqganTrainerTest, AdversarialLossCountsFromItsStartWithAnAdaptiveWeight) {
  ScratchDir runs;
  auto config = with_discriminator(tiny(4), 2);
  config.run.checkpoint_every = 1000;
  VqganTrainer(config, runs / "run").run();
  const auto lines = training_lines(runs / "run");
  for (int64_t step : {1, 2}) {
    EXPECT_EQ(lines.at(step)["adversarial_weight"].get<double>(), 0.0) << step;
    EXPECT_EQ(lines.at(step)["discriminator"].get<double>(), 0.0) << step;
  }
  for (int64_t step : {3, 4}) {
    EXPECT_GT(lines.at(step)["adversarial_weight"].get<double>(), 0.0) << step;
    EXPECT_GT(lines.at(step)["discriminator"].get<double>(), 0.0) << step << ": the hinge loss is positive";
    const double sum = lines.at(step)["reconstruction"].get<double>() + lines.at(step)["quantizer"].get<double>() +
                       lines.at(step)["adversarial_weight"].get<double>() * lines.at(step)["adversarial"].get<double>();
    EXPECT_NEAR(lines.at(step)["loss"].get<double>(), sum, 1e-5) << step;
  }
}

TEST_F(VqganTrainerTest, EncodeImagesAcceptsAVqganRun) {
  ScratchDir dir;
  VqganTrainer(tiny(2), dir / "vqgan").run();
  testing::train_caption_tokenizer(*data_ / "fc/test", dir / "tok.model", 60, 24);

  const auto info = generate::encode_images({.dataset = *data_ / "fc/test", .image_tokenizer = dir / "vqgan",
                                   .tokenizer = dir / "tok.model", .out = dir / "tokens", .batch_size = 3});
  EXPECT_EQ(info.images, 8);
  EXPECT_EQ(info.grid_height, 8);
  EXPECT_EQ(info.image_vocab_size, 32);

  const auto loaded = models::load_image_tokenizer(dir / "vqgan");
  EXPECT_EQ(loaded.kind, "vqgan");
  EXPECT_EQ(loaded.grid_size(), 8);
  const auto images = data::ImageCaptionDataset::open(*data_ / "fc/test");
  const auto tokens = data::TokenDataset::open(dir / "tokens");
  std::mt19937_64 rng(0);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < tokens->size(); ++i) {
    const auto example = tokens->get(i, rng);
    const auto source = images->get(i, rng);
    const auto resized = data::resize(source->image, 16, 16).unsqueeze(0);
    EXPECT_TRUE(torch::equal(example->image_tokens, loaded.model->encode_tokens(resized)[0])) << i;
  }
}

TEST_F(VqganTrainerTest, ARoundTripIsTheDecodedTokensOfEachImageInAnyBatch) {
  ScratchDir dir;
  VqganTrainer(tiny(2), dir / "vqgan").run();
  auto tokenizer = models::load_image_tokenizer(dir / "vqgan");
  torch::manual_seed(0);
  const auto images = torch::rand({3, 3, 16, 16});
  const auto out = models::round_trip(tokenizer, images);
  ASSERT_EQ(out.sizes(), images.sizes());
  EXPECT_FALSE(out.requires_grad());
  EXPECT_GE(out.min().item<float>(), 0.0f);
  EXPECT_LE(out.max().item<float>(), 1.0f);
  torch::NoGradGuard no_grad;
  const auto decoded = tokenizer.model->decode_tokens(tokenizer.model->encode_tokens(images)).clamp(0, 1);
  EXPECT_TRUE(torch::equal(out, decoded));
  EXPECT_TRUE(torch::allclose(models::round_trip(tokenizer, images.slice(0, 1, 2)), out.slice(0, 1, 2), 1e-5, 1e-6));
  EXPECT_GT((out - images).abs().max().item<float>(), 0.1f) << "a 2-update VQGAN cannot be lossless";
  EXPECT_THROW_WITH(models::round_trip(tokenizer, torch::rand({1, 3, 32, 32})), Error, "expected [B, C, 16, 16] images");
  EXPECT_THROW_WITH(models::round_trip(tokenizer, torch::rand({3, 16, 16})), Error, "expected [B, C, 16, 16] images");
}

// Without noise (vector quantizer, no restarts) a GPU run starts from the CPU run's weights
// and sees its batches, so their losses agree up to TF32 convolutions, resumed too; the
// gumbel noise is drawn on the GPU.
TEST_F(VqganTrainerTest, AGpuRunFollowsTheCpuRunAndResumes) {
  auto config = tiny(6, "vector");
  config.restart_every = 0;
  testing::expect_gpu_run_follows_cpu_run<VqganTrainer>(config, "reconstruction", 0.02);
  if (!torch::cuda::is_available()) return;
  ScratchDir runs;
  auto gumbel = tiny(2);
  gumbel.run.device = "cuda";
  VqganTrainer(gumbel, runs / "gumbel").run();
  EXPECT_EQ(training_lines(runs / "gumbel").size(), 2u);
}

// The decoder of a trained VQGAN learns on the tokens its frozen encoder gives: every image
// keeps its tokens, so the token datasets and priors made with them stay valid.
TEST_F(VqganTrainerTest, DecoderFineTuningKeepsEveryTokenAndMovesOnlyTheDecoder) {
  ScratchDir runs;
  VqganTrainer(tiny(6), runs / "base").run();
  auto config = with_discriminator(tiny(8), 0);
  config.init_from = runs / "base";
  config.trainable = "decoder";
  VqganTrainer(config, runs / "decoder").run();

  auto base = models::load_trained_vqgan(runs / "base"), tuned = models::load_trained_vqgan(runs / "decoder");
  const auto validation = data::ImageCaptionDataset::open(*data_ / "fc/test", {.image_size = 16});
  std::vector<torch::Tensor> images;
  for (size_t i = 0; i < validation->size(); ++i) {
    std::mt19937_64 rng(i);
    images.push_back(validation->get(i, rng)->image);
  }
  const auto batch = torch::stack(images);
  EXPECT_TRUE(torch::equal(base.model->encode_tokens(batch), tuned.model->encode_tokens(batch)));
  const auto before = base.model->named_parameters();
  int64_t moved = 0;
  for (const auto& item : tuned.model->named_parameters()) {
    const bool learned = item.key().starts_with("decoder.") || item.key().starts_with("post_quant_conv.");
    const bool same = torch::equal(item.value(), before[item.key()]);
    if (!learned) {
      EXPECT_TRUE(same) << item.key() << " is frozen";
    }
    moved += learned && !same;
  }
  EXPECT_GT(moved, 10) << "the decoder's weights move";
  for (const auto& [step, line] : training_lines(runs / "decoder")) {
    EXPECT_EQ(line["quantizer"].get<double>(), 0.0) << "update " << step;
    EXPECT_GT(line["adversarial_weight"].get<double>(), 0.0) << "update " << step;
  }
  testing::expect_exact_resume<VqganTrainer>(config);  // a resumed run starts from its checkpoint, not from init_from
}

TEST_F(VqganTrainerTest, BadSettingsAreRefused) {
  ScratchDir runs;
  testing::write_text(runs / "notes.txt", "a user's file");
  EXPECT_THROW_WITH(VqganTrainer(tiny(1), runs.path().string()), Error, "not a VQGAN run directory");
  auto config = with_discriminator(tiny(1), 0);
  config.discriminator.layers = 3;
  EXPECT_THROW_WITH(VqganTrainer(config, runs / "a"), Error, "discriminator with 3 layers needs images of at least 24");
  config = tiny(1);
  config.data.image_size = 15;
  EXPECT_THROW_WITH(VqganTrainer(config, runs / "b"), Error, "data.image_size must be a multiple of", "= 2");
  config = tiny(1);
  config.temperature.end = 0.0;
  EXPECT_THROW_WITH(VqganTrainer(config, runs / "c"), Error, "temperature.start and temperature.end must be positive");
  config = tiny(1);
  config.trainable = "decoder";
  EXPECT_THROW_WITH(VqganTrainer(config, runs / "e"), Error, "trainable: decoder", "set init_from");
  config.init_from = runs / "nowhere";
  EXPECT_THROW_WITH(VqganTrainer(config, runs / "f"), Error, "nowhere");
  EXPECT_FALSE(std::filesystem::exists(runs / "f"));
  config = tiny(1);
  config.model.norm_groups = 3;
  EXPECT_THROW_WITH(VqganTrainer(config, runs / "d"), Error, "multiple of norm_groups (3)");
  if (!torch::cuda::is_available()) {
    config = tiny(1);
    config.run.device = "cuda";
    EXPECT_THROW_WITH(VqganTrainer(config, runs / "e"), Error,
                      "vqgan training: device cuda was asked for, but torch sees no CUDA device");
    EXPECT_FALSE(std::filesystem::exists(runs / "e"));
  }

  // A run of the other kind is not resumed as this one.
  VqganTrainer(tiny(1), runs / "vq").run();
  EXPECT_THROW_WITH(models::load_trained_dvae(runs / "vq"), Error, "kind: 'vqgan' is not allowed, expected one of 'dvae'");
  auto changed = tiny(2);
  changed.model.quantizer = "vector";
  EXPECT_THROW_WITH(VqganTrainer(changed, runs / "vq"), Error, "different config", "model.quantizer (gumbel -> vector)");
}

TEST_F(VqganTrainerTest, ACudaDeviceWithoutAGpuIsRefusedBeforeAnythingIsWritten) {
  testing::expect_cuda_refused_without_a_gpu<VqganTrainer>(tiny(1), "vqgan training");
}

}  // namespace
}  // namespace dalle::train
