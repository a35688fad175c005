#include "dalle/train/trainers/superres_trainer.h"

#include <torch/torch.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "dalle/data/fashion_compose.h"
#include "dalle/io/checkpoint.h"
#include "dalle/models/trained.h"
#include "dalle/train/stop_request.h"
#include "gpu_run.h"
#include "test_support.h"
#include "trainer_harness.h"

namespace dalle::train {
namespace {

using testing::ScratchDir;
using testing::training_lines;

class SuperResTrainerTest : public testing::TrainerSuite {
 protected:
  static void SetUpTestSuite() {
    compose_data(32, 8);
  }

  // x2 on 32-pixel crops of the 64-pixel pictures: 16x16 inputs.
  static SuperResTrainConfig tiny(int64_t steps) {
    SuperResTrainConfig config;
    config.model = {.scale = 2, .num_feat = 8, .num_block = 1, .num_grow_ch = 4};
    config.data.train = *data_ / "fc/train";
    config.data.validation = *data_ / "fc/test";
    config.data.image_size = 32;
    config.data.batch_size = 4;
    config.degradation.blur_sigma = {0.2, 1.0};
    config.degradation.noise_sigma = {1.0, 5.0};
    config.degradation.jpeg_quality = {70, 95};
    config.learning_rate = {.start = 2e-3, .end = 2e-3, .steps = 0};
    config.run = testing::quick_run(steps);
    config.grid_images = 2;
    config.validation_images = 8;
    config.optimizer.ema_decay = 0.8;
    return config;
  }
};

TEST_F(SuperResTrainerTest, DegradedBatchesAreFixedBySeedAndStep) {
  auto config = tiny(1);
  torch::manual_seed(0);
  const auto high = torch::rand({3, 3, 32, 32});
  const auto low = SuperResTrainer::degrade_batch(high, config, 5);
  EXPECT_EQ(low.sizes(), (std::vector<int64_t>{3, 3, 16, 16}));
  EXPECT_TRUE(torch::equal(low, SuperResTrainer::degrade_batch(high, config, 5)));
  EXPECT_FALSE(torch::equal(low, SuperResTrainer::degrade_batch(high, config, 6))) << "another update";
  EXPECT_FALSE(torch::equal(low[0], SuperResTrainer::degrade_batch(high.flip(0), config, 5)[2]))
      << "each place in the batch draws its own degradation";
  config.run.seed = 1;
  EXPECT_FALSE(torch::equal(low, SuperResTrainer::degrade_batch(high, config, 5))) << "another seed";
}

TEST_F(SuperResTrainerTest, LossGoesDownAndBeatsItsStartOnValidation) {
  testing::LearningRun<SuperResTrainer> run(tiny(40));
  const double first = testing::mean_metric(run.lines, "loss", 1, 5);
  const double last = testing::mean_metric(run.lines, "loss", 36, 40);
  EXPECT_LT(last, 0.7 * first) << "L1 " << first << " -> " << last;
  const auto trained = run.trainer.validate();
  EXPECT_GT(trained.psnr, run.untrained.psnr + 3.0) << run.untrained.psnr << " -> " << trained.psnr;
  EXPECT_EQ(trained.bicubic_psnr, run.untrained.bicubic_psnr) << "the same degraded inputs at every validation";
  EXPECT_EQ(trained.images, 8);
  std::printf("L1 %.4f -> %.4f; validation PSNR %.2f -> %.2f dB, bicubic %.2f dB\n", first, last, run.untrained.psnr,
              trained.psnr, trained.bicubic_psnr);
  EXPECT_TRUE(std::filesystem::exists(run.runs / "run/samples/step-000000040.png"));
  const auto grid = testing::read_text(run.runs / "run/metrics.jsonl");
  EXPECT_THAT(grid, ::testing::HasSubstr("\"bicubic_psnr\""));
  EXPECT_THAT(grid, ::testing::HasSubstr("\"psnr_gain\""));
}

// A stop requested before run() trains nothing; once cleared, the run trains as usual. (A stop
// in the middle of a run, by SIGTERM, is in tools_test.cpp.)
TEST_F(SuperResTrainerTest, AStopRequestedBeforeTheRunTrainsNothing) {
  ScratchDir runs;
  SuperResTrainer trainer(tiny(2), runs / "run");
  request_stop();
  trainer.run();
  clear_stop_request();
  EXPECT_EQ(trainer.step(), 0);
  EXPECT_TRUE(training_lines(runs / "run").empty());
  EXPECT_FALSE(std::filesystem::exists(runs / "run/checkpoints/latest"));
  trainer.run();
  EXPECT_EQ(trainer.step(), 2);
  EXPECT_EQ(training_lines(runs / "run").size(), 2u);
}

// Two trainers given one run folder would interleave their checkpoints and metrics.
TEST_F(SuperResTrainerTest, ASecondTrainerOnARunInUseIsRefused) {
  ScratchDir runs;
  {
    SuperResTrainer first(tiny(1), runs / "run");
    try {
      SuperResTrainer second(tiny(1), runs / "run");
      ADD_FAILURE() << "a second trainer opened a run in use";
    } catch (const Error& error) {
      EXPECT_THAT(error.what(), ::testing::HasSubstr("is in use by another super-resolution run (process " +
                                                     std::to_string(::getpid()) + " holds"));
    }
  }
  SuperResTrainer again(tiny(1), runs / "run");  // the lock went with the first trainer
  again.run();
  EXPECT_EQ(again.step(), 1);

  // A run stopped before its first metrics line holds its lock file and config.yaml: it resumes.
  std::filesystem::create_directories(runs / "early");
  testing::write_text(runs / "early/.lock", "12345");
  testing::write_text(runs / "early/config.yaml", "");
  EXPECT_NO_THROW(SuperResTrainer(tiny(1), runs / "early"));
}

TEST_F(SuperResTrainerTest, ResumedRunContinuesWithTheSameLossesAndWeights) {
  testing::expect_exact_resume<SuperResTrainer>(tiny(8));
}

// CPU results depend on the thread count in their last bits, so a resume does not take
// whatever the machine's load suggests at restart.
TEST_F(SuperResTrainerTest, AResumedRunComputesWithTheThreadsItsCheckpointWasWrittenWith) {
  ScratchDir runs;
  auto started = tiny(3);
  started.run.threads = 2;
  SuperResTrainer(started, runs / "run").run();
  EXPECT_EQ(io::load_checkpoint(runs / "run/checkpoints/step-000000003").state_metadata.at("torch_threads"), "2");
  at::set_num_threads(1);
  {
    SuperResTrainer resumed(tiny(4), runs / "run");  // run.threads 0: the checkpoint's count
    EXPECT_EQ(resumed.step(), 3);
    EXPECT_EQ(at::get_num_threads(), 2);
  }
  auto chosen = tiny(4);
  chosen.run.threads = 1;
  SuperResTrainer resumed(chosen, runs / "run");
  EXPECT_EQ(at::get_num_threads(), 1) << "a count the recipe names wins";
}

TEST_F(SuperResTrainerTest, ResumedBf16RunContinuesWithTheSameLossesAndWeights) {
  auto config = tiny(8);
  config.precision.mode = "bfloat16";
  config.precision.adam_moments = "bfloat16";
  testing::expect_exact_resume<SuperResTrainer>(config);
}

TEST_F(SuperResTrainerTest, TheRunLoadsAsANetworkWithItsEmaWeights) {
  ScratchDir runs;
  SuperResTrainer(tiny(3), runs / "run").run();
  auto net = models::load_trained_rrdbnet(runs / "run");
  EXPECT_FALSE(net->is_training());
  const auto checkpoint = io::load_checkpoint(runs / "run/checkpoints/step-000000003");
  const auto ema = io::with_prefix_removed(checkpoint.state, "ema.");
  for (const auto& item : net->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), ema.at(item.key()))) << item.key();
  }
  EXPECT_FALSE(torch::equal(ema.at("conv_first.weight"), checkpoint.weights.at("conv_first.weight")));
}

TEST_F(SuperResTrainerTest, BadSettingsAreRefused) {
  ScratchDir runs;
  testing::write_text(runs / "notes.txt", "a user's file");
  EXPECT_THROW_WITH(SuperResTrainer(tiny(1), runs.path().string()), Error, "not a super-resolution run directory");
  auto config = tiny(1);
  config.data.image_size = 30;
  EXPECT_THROW_WITH(SuperResTrainer(config, runs / "a"), Error, "data.image_size (30) must be a multiple of 4",
                    "model.scale 2 times the pixel-unshuffle factor 2");
  config = tiny(1);
  config.model.scale = 3;
  EXPECT_THROW_WITH(SuperResTrainer(config, runs / "b"), Error, "scale must be 1, 2, 4 or 8, got 3");
  config = tiny(1);
  config.degradation.blur_sigma = {2.0, 1.0};
  EXPECT_THROW_WITH(SuperResTrainer(config, runs / "c"), Error, "degradation.blur_sigma: min");
  config = tiny(1);
  config.model.num_out_ch = 1;
  EXPECT_THROW_WITH(SuperResTrainer(config, runs / "d"), Error, "num_out_ch must be 3");

  const auto source = ConfigSource::from_string("degradation:\n  blur_sigm: {min: 1, max: 2}\n", "sr.yaml");
  EXPECT_THROW_WITH(load_config<SuperResTrainConfig>(source), ConfigError, "sr.yaml:2:3",
                    "unknown key 'degradation.blur_sigm'", "did you mean 'degradation.blur_sigma'");
  EXPECT_THROW_WITH(load_config<SuperResTrainConfig>(ConfigSource::from_string("kind: vqgan\n", "k.yaml")),
                    ConfigError, "k.yaml:1:7", "kind: 'vqgan' is not allowed");

  // A resume under another recipe is refused; how long and how often may change.
  SuperResTrainer(tiny(1), runs / "sr").run();
  auto changed = tiny(2);
  changed.degradation.jpeg_quality.min = 50;
  EXPECT_THROW_WITH(SuperResTrainer(changed, runs / "sr"), Error, "different config",
                    "degradation.jpeg_quality.min");
  auto longer = tiny(2);
  longer.validation_images = 4;
  EXPECT_NO_THROW(SuperResTrainer(longer, runs / "sr"));
}

// The degradation is drawn on the CPU, so the GPU run trains on the CPU run's pairs.
TEST_F(SuperResTrainerTest, AGpuRunFollowsTheCpuRunAndResumes) {
  testing::expect_gpu_run_follows_cpu_run<SuperResTrainer>(tiny(6), "loss", 0.02);
}

TEST_F(SuperResTrainerTest, ACudaDeviceWithoutAGpuIsRefusedBeforeAnythingIsWritten) {
  testing::expect_cuda_refused_without_a_gpu<SuperResTrainer>(tiny(1), "super-resolution training");
}

}  // namespace
}  // namespace dalle::train
