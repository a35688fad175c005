#include "dalle/train/trainers/bart_prior_trainer.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "dalle/data/token_dataset.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/adapter.h"
#include "dalle/models/export_weights.h"
#include "dalle/models/trained.h"
#include "gpu_run.h"
#include "trainer_harness.h"
#include "test_support.h"

namespace dalle::train {
namespace {

using testing::ScratchDir;

const std::vector<std::string> kWords = {"red", "blue", "green", "cyan"};

// A BART vocab.json and merges.txt whose words are kWords: "Ġred" is merged from "Ġ r e d".
void write_bart_tokenizer(const std::string& folder) {
  std::filesystem::create_directories(folder);
  std::string vocab = R"({"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3)";
  std::string merges = "#version: 0.2\n";
  for (size_t w = 0; w < kWords.size(); ++w) {
    std::string merged = "\u0120";
    for (const char c : kWords[w]) {
      merges += merged + " " + c + "\n";
      merged += c;
    }
    vocab += ", \"" + merged + "\": " + std::to_string(4 + w);
  }
  testing::write_text(folder + "/vocab.json", vocab + "}");
  testing::write_text(folder + "/merges.txt", merges);
}

// "a <word>" captions with 4x4 image grids that are a function of the word.
void write_token_dataset(const std::string& directory, int64_t images, uint64_t seed) {
  data::TokenDatasetWriter writer(directory, {.image_vocab_size = 16, .text_vocab_size = 8, .grid_height = 4,
                                              .grid_width = 4, .text_length = 8, .source = "synthetic"});
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < images; ++i) {
    const auto word = static_cast<int64_t>(rng() % kWords.size());
    const auto image = (torch::arange(16).view({4, 4}) * (word + 1)) % 16;
    writer.add(image, torch::zeros({1, 8}, torch::kInt64), {"a " + kWords[static_cast<size_t>(word)]});
  }
  writer.finish();
}

models::BartPriorConfig tiny_model() {
  return {.layers = 2, .heads = 2, .width = 32, .glu_width = 48, .text_vocab_size = 8, .text_length = 8,
          .image_vocab_size = 16, .image_length = 16, .codes = 16};
}

class BartPriorTrainerTest : public testing::TrainerSuite {
 protected:
  static void SetUpTestSuite() {
    make_data();
    write_bart_tokenizer(*data_ / "tokenizer");
    write_token_dataset(*data_ / "train", 64, 1);
    write_token_dataset(*data_ / "validation", 16, 2);
  }

  static BartPriorTrainConfig tiny(int64_t steps) {
    BartPriorTrainConfig config;
    config.tokenizer = *data_ / "tokenizer";
    config.model = tiny_model();
    config.data.train = *data_ / "train";
    config.data.validation = *data_ / "validation";
    config.data.batch_size = 8;
    config.data.caption_dropout = 0.25;
    config.learning_rate = {3e-3, 1e-4, steps};
    config.run = testing::quick_run(steps);
    config.optimizer.ema_decay = 0.8;
    return config;
  }
};

TEST_F(BartPriorTrainerTest, ResumedRunContinuesWithTheSameLosses) {
  testing::expect_exact_resume<BartPriorTrainer>(tiny(8));
}

TEST_F(BartPriorTrainerTest, ResumedFp16RunContinuesWithTheSameLossesAndScale) {
  auto config = tiny(8);
  config.precision.mode = "float16";
  testing::expect_exact_resume<BartPriorTrainer>(config);
}

TEST_F(BartPriorTrainerTest, LossGoesDownAndTheRunLoadsAsABartPrior) {
  auto config = tiny(60);
  config.run.validate_every = 60;
  testing::LearningRun<BartPriorTrainer> run(config);
  const auto trained = run.trainer.validate();
  EXPECT_LT(trained.loss, 0.5 * run.untrained.loss) << "validation loss " << run.untrained.loss << " -> "
                                                   << trained.loss;
  EXPECT_LT(testing::mean_metric(run.lines, "loss", 51, 60), testing::mean_metric(run.lines, "loss", 1, 10));
  const auto loaded = models::load_trained_bart_prior(run.runs / "run");
  EXPECT_EQ(loaded.config.image_length, 16);
  EXPECT_EQ(loaded.tokenizer, config.tokenizer);
  // The loaded weights are the checkpoint's moving average, not the last update's weights.
  const auto checkpoint = io::load_checkpoint(run.runs / "run/checkpoints/step-000000060");
  const auto weights = io::state_dict(*loaded.model);
  for (const auto& [name, tensor] : weights) {
    EXPECT_TRUE(torch::equal(tensor, checkpoint.state.at("ema." + name))) << name;
  }
  EXPECT_FALSE(torch::equal(weights.at("decoder.lm_head.weight"), checkpoint.weights.at("decoder.lm_head.weight")));
}

// optimizer.trainable in another trainer: only the output layer and the norms train; the
// encoder and the decoder's attention and GLU weights stay as they were, without moments.
TEST_F(BartPriorTrainerTest, FrozenParametersStayAsTheyWereAndHaveNoMoments) {
  ScratchDir runs;
  auto config = tiny(4);
  config.run.checkpoint_every = 2;
  config.optimizer.trainable = {"decoder.lm_head.*", "*layer_norm*"};
  BartPriorTrainer(config, runs / "run").run();
  const auto early = io::load_checkpoint(runs / "run/checkpoints/step-000000002");
  const auto late = io::load_checkpoint(runs / "run/checkpoints/step-000000004");
  int64_t frozen = 0, trained = 0;
  for (const auto& [name, tensor] : late.weights) {
    const bool trains = name.rfind("decoder.lm_head.", 0) == 0 || name.find("layer_norm") != std::string::npos;
    EXPECT_EQ(late.state.count("adamw." + name + ".exp_avg") > 0, trains) << name << ": moments only if it trains";
    if (trains) {
      ++trained;
      EXPECT_FALSE(torch::equal(tensor, early.weights.at(name))) << name << " trains";
    } else {
      ++frozen;
      EXPECT_TRUE(torch::equal(tensor, early.weights.at(name))) << name << " is frozen";
    }
  }
  EXPECT_GT(frozen, 10);
  EXPECT_GT(trained, 2);
}

TEST_F(BartPriorTrainerTest, FineTuningStartsFromTheInitCheckpointAndResumesWithoutIt) {
  ScratchDir runs;
  torch::manual_seed(7);
  models::BartPrior initial(tiny_model());
  io::save_checkpoint(runs / "init",
                      {.config_yaml = "kind: bart_prior\nmodel:\n  layers: 2\n  heads: 2\n  width: 32\n  glu_width: 48\n"
                                      "  text_vocab_size: 8\n  text_length: 8\n  image_vocab_size: 16\n"
                                      "  image_length: 16\n  codes: 16\n",
                       .weights = io::state_dict(*initial)});
  auto config = tiny(1);
  config.init = runs / "init";
  config.model = models::dalle_mini_config();  // replaced by init's sizes
  {
    BartPriorTrainer trainer(config, runs / "run");
    const auto started = io::state_dict(*trainer.model());
    for (const auto& [name, tensor] : io::state_dict(*initial)) {
      EXPECT_TRUE(torch::equal(started.at(name).cpu(), tensor)) << name;
    }
    trainer.run();
    EXPECT_FALSE(torch::equal(io::state_dict(*trainer.model()).at("encoder.final_ln.weight").cpu(),
                              io::state_dict(*initial).at("encoder.final_ln.weight")));
  }
  // A resumed run reads its own checkpoint, sizes included, and never init again.
  std::filesystem::remove_all(runs / "init");
  config.run.steps = 2;
  BartPriorTrainer resumed(config, runs / "run");
  EXPECT_EQ(resumed.step(), 1);
  resumed.run();
  EXPECT_EQ(resumed.step(), 2);
}

// Adapters on the decoder's attention of a BART prior started from a checkpoint: they alone
// train; the checkpoint holds them and refers to init for the rest; the merged export is init
// plus the exported adapter file.
TEST_F(BartPriorTrainerTest, AdaptersTrainAloneAndMergeIntoTheInitWeights) {
  ScratchDir runs;
  torch::manual_seed(8);
  models::BartPrior initial(tiny_model());
  const auto initial_weights = io::state_dict(*initial);
  io::save_checkpoint(runs / "init",
                      {.config_yaml = "kind: bart_prior\nmodel:\n  layers: 2\n  heads: 2\n  width: 32\n  glu_width: 48\n"
                                      "  text_vocab_size: 8\n  text_length: 8\n  image_vocab_size: 16\n"
                                      "  image_length: 16\n  codes: 16\n",
                       .weights = initial_weights});
  auto config = tiny(3);
  config.run.checkpoint_every = 3;
  config.init = runs / "init";
  config.adapter = {.rank = 2, .alpha = 2, .targets = {"decoder.layers.*.self_attn.*_proj"}};
  BartPriorTrainer(config, runs / "run").run();
  const std::string directory = runs / "run/checkpoints/step-000000003";
  const auto own = io::read_safetensors(directory + "/model.safetensors").tensors;
  EXPECT_EQ(own.size(), models::adapter_tensors(own).size()) << "only the adapters, no frozen weight";
  EXPECT_EQ(own.size(), 16u) << "lora_A and lora_B of q, k, v and out in 2 layers";
  const auto trained = io::inference_weights(io::load_checkpoint(directory));
  for (const auto& [name, tensor] : initial_weights) {
    EXPECT_TRUE(torch::equal(trained.at(name), tensor)) << name << " is frozen";
  }
  EXPECT_FALSE(torch::equal(trained.at("decoder.layers.0.self_attn.q_proj.lora_B.weight"),
                            torch::zeros_like(trained.at("decoder.layers.0.self_attn.q_proj.lora_B.weight"))));

  models::export_weights(runs / "run", runs / "merged");
  models::export_adapter(runs / "run", runs / "adapter.safetensors");
  const auto adapter = models::load_adapter_file(runs / "adapter.safetensors");
  EXPECT_EQ(adapter.family, "bart_prior");
  const auto merged = io::load_checkpoint(runs / "merged").weights;
  const auto expected = models::merge_adapter_tensors(initial_weights, adapter.tensors, adapter.scale());
  int64_t changed = 0;
  for (const auto& [name, tensor] : expected) {
    EXPECT_LT(testing::relative_error(merged.at(name), tensor), 1e-6) << name;
    changed += torch::equal(tensor, initial_weights.at(name)) ? 0 : 1;
  }
  EXPECT_EQ(changed, 8) << "q, k, v and out of the decoder's 2 self-attentions";
  EXPECT_EQ(models::load_trained_bart_prior(runs / "merged").config.layers, 2);
}

TEST_F(BartPriorTrainerTest, AGpuRunFollowsTheCpuRunAndResumes) {
  testing::expect_gpu_run_follows_cpu_run<BartPriorTrainer>(tiny(6), "loss", 1e-3);
}

TEST_F(BartPriorTrainerTest, ACudaDeviceWithoutAGpuIsRefusedBeforeAnythingIsWritten) {
  testing::expect_cuda_refused_without_a_gpu<BartPriorTrainer>(tiny(1), "BART prior training");
}

TEST_F(BartPriorTrainerTest, BadSettingsAreRefused) {
  ScratchDir runs;
  auto config = tiny(1);
  config.tokenizer = "";
  EXPECT_THROW_WITH(BartPriorTrainer(config, runs / "a"), Error, "`tokenizer` must name a folder");
  config = tiny(1);
  config.model.image_length = 256;
  EXPECT_THROW_WITH(BartPriorTrainer(config, runs / "b"), Error, "holds 4x4 grids of 16 image tokens",
                    "the prior draws 256 tokens");
  EXPECT_THROW(load_config<BartPriorTrainConfig>(ConfigSource::from_string("data: {batch_size: 0}", "recipe")),
               ConfigError);
}

}  // namespace
}  // namespace dalle::train
