#include "dalle/train/trainers/clip_trainer.h"

#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/fashion_compose.h"
#include "dalle/data/image.h"
#include "dalle/io/state_dict.h"
#include "dalle/text/tokenizer.h"
#include "dalle/models/trained.h"
#include "dalle/train/trainers/vqgan_trainer.h"
#include "gpu_run.h"
#include "test_support.h"
#include "trainer_harness.h"
#include "tiny_vqgan.h"

namespace dalle::train {
namespace {

using testing::ScratchDir;
using testing::training_lines;

class ClipTrainerTest : public testing::TrainerSuite {
 protected:
  static void SetUpTestSuite() {
    compose_data(48, 16);
    testing::train_caption_tokenizer(*data_ / "fc/train", *data_ / "tok.model", 60, 16);
    write_halves(*data_ / "halves");
  }

  // A small synthetic set CLIP learns quickly: 16x16 images whose left or right half is one
  // of fashion-compose's 8 colours, "a <colour> bag on the <side>", 4 images per caption.
  static void write_halves(const std::string& root) {
    std::filesystem::create_directories(root + "/images");
    std::ofstream tsv(root + "/captions.tsv");
    torch::manual_seed(0);
    int index = 0;
    for (const auto& colour : data::fashion_compose_colours()) {
      for (const std::string side : {"left", "right"}) {
        for (int copy = 0; copy < 4; ++copy, ++index) {
          auto image = torch::rand({3, 16, 16}) * 0.1;
          const auto rgb = torch::tensor({colour.rgb[0], colour.rgb[1], colour.rgb[2]}).view({3, 1, 1});
          image.slice(2, side == "left" ? 0 : 8, side == "left" ? 8 : 16) = rgb * (0.8 + 0.05 * copy);
          const std::string name = "images/" + std::to_string(index) + ".png";
          data::write_png(root + "/" + name, image);
          tsv << name << "\ta " << colour.name << " bag on the " << side << "\n";
        }
      }
    }
  }

  static ClipTrainConfig tiny(int64_t steps) {
    ClipTrainConfig config;
    auto& m = config.model;
    m.embed_dim = 16;
    m.image_size = 16;
    m.patch_size = 4;
    m.vision_width = 32;
    m.vision_layers = 1;
    m.vision_heads = 2;
    m.context_length = 16;
    m.vocab_size = 64;
    m.text_width = 32;
    m.text_layers = 1;
    m.text_heads = 2;
    m.activation = "gelu";
    m.text_pooling = "eos";
    m.eos_id = 3;
    config.data.train = *data_ / "fc/train";
    config.data.validation = *data_ / "fc/test";
    config.data.image_size = 16;
    config.data.batch_size = 8;
    config.data.workers = 1;
    config.tokenizer = *data_ / "tok.model";
    config.warmup_steps = 2;
    config.learning_rate = {.start = 2e-3, .end = 2e-3, .steps = 0};
    config.optimizer.weight_decay = 0.01;
    config.run = testing::quick_run(steps);
    config.optimizer.ema_decay = 0.8;
    return config;
  }
};

TEST_F(ClipTrainerTest, ResumedRunContinuesWithTheSameLosses) { testing::expect_exact_resume<ClipTrainer>(tiny(8)); }

TEST_F(ClipTrainerTest, ResumedFp16RunContinuesWithTheSameLossesAndScale) {
  auto config = tiny(8);
  config.precision.mode = "float16";
  config.precision.adam_moments = "bfloat16";
  testing::expect_exact_resume<ClipTrainer>(config);
}

TEST_F(ClipTrainerTest, LossGoesDownAndTrainingImagesFindTheirCaptions) {
  auto config = tiny(60);
  config.data.train = config.data.validation = *data_ / "halves";  // retrieval among the training images
  config.validation_images = 64;
  config.optimizer.ema_decay = 0.0;
  testing::LearningRun<ClipTrainer> run(config);
  const double first = testing::mean_metric(run.lines, "loss", 1, 5);
  const double last = testing::mean_metric(run.lines, "loss", 56, 60);
  EXPECT_LT(last, 0.6 * first) << "contrastive loss " << first << " -> " << last;
  const auto trained = run.trainer.validate();
  EXPECT_EQ(trained.images, 64);
  EXPECT_GT(trained.image_to_text, run.untrained.image_to_text + 0.2);
  EXPECT_GT(trained.text_to_image, run.untrained.text_to_image + 0.2);
  EXPECT_LT(trained.loss, run.untrained.loss);
  // The learned scale moved, and stays within the clamp.
  EXPECT_NE(run.lines.at(60)["logit_scale"].get<double>(), config.model.init_logit_scale);
  EXPECT_LE(run.lines.at(60)["logit_scale"].get<double>(), config.max_logit_scale);
  // The validation lines are in the log beside the training lines.
  std::ifstream in(run.runs / "run/metrics.jsonl");
  int validations = 0;
  for (std::string line; std::getline(in, line);) {
    validations += nlohmann::json::parse(line).contains("validation_image_to_text");
  }
  EXPECT_EQ(validations, 3) << "the two explicit validations and the one after the last update";
}

TEST_F(ClipTrainerTest, LogitScaleIsClampedAtTheMaximum) {
  ScratchDir runs;
  auto config = tiny(3);
  config.model.init_logit_scale = 4.0;
  config.max_logit_scale = 3.0;  // below the initial value: the first update clamps it
  config.run.checkpoint_every = 1000;
  ClipTrainer(config, runs / "run").run();
  const auto lines = training_lines(runs / "run");
  EXPECT_EQ(lines.at(1)["logit_scale"].get<double>(), 3.0) << "clamped after the first update";
  for (const auto& [step, line] : lines) EXPECT_LE(line["logit_scale"].get<double>(), 3.0) << step;
}

TEST_F(ClipTrainerTest, ATrainedRunLoadsForReranking) {
  ScratchDir runs;
  auto config = tiny(3);
  config.optimizer.ema_decay = 0.0;  // the average is the weights themselves
  ClipTrainer trainer(config, runs / "run");
  trainer.run();
  const auto loaded = models::load_trained_clip(runs / "run");
  EXPECT_FALSE(loaded->is_training());
  EXPECT_EQ(loaded->config().text_pooling, "eos");
  const auto trained = io::state_dict(*trainer.model());
  for (const auto& [name, tensor] : io::state_dict(*loaded)) {
    EXPECT_TRUE(torch::equal(tensor, trained.at(name))) << name;
  }
}

// With through_tokenizer, CLIP learns the decoder's version of every image, as it will see
// the prior's samples when it reranks them; the run still resumes exactly.
TEST_F(ClipTrainerTest, ThroughTokenizerTrainsOnTheDecodersImagesAndResumes) {
  ScratchDir runs;
  VqganTrainer(testing::tiny_vqgan_config(*data_ / "fc/train", *data_ / "fc/test", 2), runs / "vqgan").run();
  auto config = tiny(3);
  config.through_tokenizer = runs / "vqgan";
  ClipTrainer(tiny(3), runs / "real").run();
  ClipTrainer(config, runs / "decoded").run();
  const auto real = training_lines(runs / "real"), decoded = training_lines(runs / "decoded");
  ASSERT_EQ(decoded.size(), 3u);
  EXPECT_NE(decoded.at(1)["loss"], real.at(1)["loss"]) << "the same weights and batch, other pixels";
  EXPECT_THAT(testing::read_text(runs / "decoded/config.yaml"), ::testing::HasSubstr("through_tokenizer:"));
  testing::expect_exact_resume<ClipTrainer>(config);

  // Later epochs read the kept round trips (48 images, 6 updates an epoch): the same
  // losses as round-tripping every image at every use.
  config.run.steps = 14;
  ClipTrainer(config, runs / "kept").run();
  config.through_tokenizer_cache_mb = 0;
  ClipTrainer(config, runs / "every-time").run();
  const auto kept = training_lines(runs / "kept"), every_time = training_lines(runs / "every-time");
  for (int64_t step = 1; step <= 14; ++step) {
    EXPECT_NEAR(kept.at(step)["loss"].get<double>(), every_time.at(step)["loss"].get<double>(), 1e-5) << step;
  }
  const auto last_validation = [](const std::filesystem::path& run) {
    nlohmann::json last;
    std::ifstream in(run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      if (auto record = nlohmann::json::parse(line); record.contains("kept_round_trips")) last = record;
    }
    return last;
  };
  EXPECT_EQ(last_validation(runs / "kept")["kept_round_trips"], 48 + 16) << "every training and validation image";
  EXPECT_EQ(last_validation(runs / "every-time")["kept_round_trips"], 0);

  config.data.image_size = 32;
  EXPECT_THROW_WITH(ClipTrainer(config, runs / "sizes"), Error, "was trained on 16px images, data.image_size is 32");
  EXPECT_FALSE(std::filesystem::exists(runs / "sizes"));
  config.through_tokenizer = runs / "none";
  EXPECT_THROW_WITH(ClipTrainer(config, runs / "missing"), Error, "none");
}

// hard_negatives replaces the second half of each batch of the halves set with images of
// the other side or another colour; the batches differ, and the run still resumes exactly.
TEST_F(ClipTrainerTest, HardNegativesChangeTheBatchesAndResume) {
  ScratchDir runs;
  auto random = tiny(2), hard = tiny(2);
  random.data.train = hard.data.train = *data_ / "halves";
  hard.hard_negatives = 0.5;
  ClipTrainer(random, runs / "random").run();
  ClipTrainer(hard, runs / "hard").run();
  EXPECT_NE(training_lines(runs / "hard").at(1)["loss"], training_lines(runs / "random").at(1)["loss"]);
  testing::expect_exact_resume<ClipTrainer>(hard);
}

// word_dropout shows half the captions of the halves set without their colour ("a bag on the
// left"); the batches differ, and the run still resumes exactly.
TEST_F(ClipTrainerTest, WordDropoutChangesTheCaptionsAndResumes) {
  ScratchDir runs;
  auto plain = tiny(2), dropped = tiny(2);
  plain.data.train = dropped.data.train = *data_ / "halves";
  dropped.word_dropout = 0.5;
  dropped.dropped_words = {"red", "orange", "yellow", "green", "cyan", "blue", "purple", "white"};
  ClipTrainer(plain, runs / "plain").run();
  ClipTrainer(dropped, runs / "dropped").run();
  EXPECT_NE(training_lines(runs / "dropped").at(1)["loss"], training_lines(runs / "plain").at(1)["loss"]);
  testing::expect_exact_resume<ClipTrainer>(dropped);
}

TEST(ClipTraining, ContrastiveLossAndSchedule) {
  EXPECT_NEAR(clip_contrastive_loss(torch::zeros({5, 5})).item<double>(), std::log(5.0), 1e-6);
  EXPECT_LT(clip_contrastive_loss(torch::eye(4) * 50).item<double>(), 1e-6);
  // Both directions count: image 0 matching every caption costs ln 3 in its row (image->text)
  // and ln 2 in the columns of captions 1 and 2 (text->image).
  auto logits = torch::eye(3) * 50;
  logits[0].fill_(50);
  EXPECT_NEAR(clip_contrastive_loss(logits).item<double>(), (std::log(3.0) / 3 + 2 * std::log(2.0) / 3) / 2, 1e-5);
  EXPECT_THROW_WITH(clip_contrastive_loss(torch::zeros({2, 3})), Error, "square");

  ClipTrainConfig config;
  config.warmup_steps = 4;
  config.learning_rate = {.start = 1.0, .end = 0.0, .steps = 10};
  EXPECT_DOUBLE_EQ(config.learning_rate_at(0), 0.25);
  EXPECT_DOUBLE_EQ(config.learning_rate_at(3), 1.0);
  EXPECT_DOUBLE_EQ(config.learning_rate_at(4), 1.0);
  EXPECT_NEAR(config.learning_rate_at(9), 0.5, 1e-12);
  EXPECT_DOUBLE_EQ(config.learning_rate_at(100), 0.0);
}

TEST_F(ClipTrainerTest, BadSettingsAreRefused) {
  ScratchDir runs;
  auto config = tiny(2);
  config.model.text_pooling = "argmax";
  EXPECT_THROW_WITH(ClipTrainer(config, runs / "a"), Error, "text_pooling: eos", "eos_id: 3");
  config = tiny(2);
  config.model.vocab_size = 32;
  EXPECT_THROW_WITH(ClipTrainer(config, runs / "b"), Error, "tok.model", "60 ids, more than model.vocab_size (32)");
  config = tiny(2);
  config.model.context_length = 8;
  EXPECT_THROW_WITH(ClipTrainer(config, runs / "c"), Error, "16 ids per caption", "model.context_length (8)");
  config = tiny(2);
  config.tokenizer = "";
  EXPECT_THROW_WITH(ClipTrainer(config, runs / "d"), Error, "tokenizer must name");
  config = tiny(2);
  config.data.batch_size = 1;
  EXPECT_THROW_WITH(ClipTrainer(config, runs / "e"), Error, "batch_size must be at least 2");
  config = tiny(2);
  config.hard_negatives = 0.6;
  EXPECT_THROW_WITH(ClipTrainer(config, runs / "f"), Error, "hard_negatives must be between 0 and 0.5");
  config = tiny(2);
  config.word_dropout = 0.25;
  EXPECT_THROW_WITH(ClipTrainer(config, runs / "g"), Error, "word_dropout needs the words to drop");
  testing::write_text(runs / "notes.txt", "a user's file");
  EXPECT_THROW_WITH(ClipTrainer(tiny(2), runs.path().string()), Error, "not a CLIP run directory");
  EXPECT_FALSE(std::filesystem::exists(runs / "a/config.yaml"));

  EXPECT_THROW_WITH(load_config<ClipTrainConfig>(ConfigSource::from_string("model:\n  embed_dimm: 8\n", "c.yaml")),
                    ConfigError, "c.yaml:2:3: unknown key 'model.embed_dimm' (did you mean 'model.embed_dim'?)");
  EXPECT_THROW_WITH(load_config<ClipTrainConfig>(ConfigSource::from_string("warmup_step: 8\n", "c.yaml")),
                    ConfigError, "unknown key 'warmup_step'");
  EXPECT_THROW_WITH(load_config<ClipTrainConfig>(ConfigSource::from_string("kind: vqgan\n", "c.yaml")), ConfigError,
                    "kind: 'vqgan' is not allowed");

  // A resume under a changed model is refused and leaves the run as it was.
  ClipTrainer(tiny(3), runs / "run").run();
  auto changed = tiny(6);
  changed.model.text_width = 64;
  EXPECT_THROW_WITH(ClipTrainer(changed, runs / "run"), Error, "different config", "model.text_width (32 -> 64)");
  auto longer = tiny(6);
  longer.validation_images = 8;
  EXPECT_EQ(ClipTrainer(longer, runs / "run").step(), 3) << "steps and validation_images may change";
}

// No noise: the GPU run sees the CPU run's batches and captions.
TEST_F(ClipTrainerTest, AGpuRunFollowsTheCpuRunAndResumes) {
  testing::expect_gpu_run_follows_cpu_run<ClipTrainer>(tiny(6), "loss", 0.02);
}

TEST_F(ClipTrainerTest, ACudaDeviceWithoutAGpuIsRefusedBeforeAnythingIsWritten) {
  testing::expect_cuda_refused_without_a_gpu<ClipTrainer>(tiny(1), "clip training");
}

}  // namespace
}  // namespace dalle::train
