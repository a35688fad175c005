#include "dalle/train/trainers/prior_trainer.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/adapter.h"
#include "dalle/models/export_weights.h"
#include "dalle/models/trained.h"
#include "dalle/data/token_dataset.h"
#include "gpu_run.h"
#include "trainer_harness.h"
#include "test_support.h"

namespace dalle::train {
namespace {

using testing::ScratchDir;

// Captions [eos-terminated word, padding] and 4x4 image grids that are a function of the
// caption's word, so that a prior can learn them: cell c of word w's grid is (c * stride + w)
// mod 16, so that another stride teaches the same captions other images.
void write_token_dataset(const std::string& directory, int64_t images, uint64_t seed, int64_t stride = 1) {
  data::TokenDatasetWriter writer(directory, {.image_vocab_size = 16, .text_vocab_size = 24, .grid_height = 4,
                                              .grid_width = 4, .text_length = 6, .source = "synthetic"});
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < images; ++i) {
    const int64_t word = 4 + static_cast<int64_t>(rng() % 8);
    const auto text = torch::tensor({word, int64_t{3}, int64_t{0}, int64_t{0}, int64_t{0}, int64_t{0}}).view({1, 6});
    const auto image = (torch::arange(16).view({4, 4}) * stride + word) % 16;
    writer.add(image, text, {"word " + std::to_string(word)});
  }
  writer.finish();
}

class PriorTrainerTest : public testing::TrainerSuite {
 protected:
  static void SetUpTestSuite() {
    make_data();
    write_token_dataset(*data_ / "train", 64, 1);
    write_token_dataset(*data_ / "validation", 16, 2);
  }

  // A caption and image tokens for the tiny prior.
  static torch::Tensor tokens_for_test() {
    return torch::cat({torch::tensor({5, 3, 0, 0, 0, 0}), (torch::arange(16) + 5) % 16}).view({1, 22});
  }
  // A tiny prior trained 3 updates into `run`, the base the fine-tuning tests start from.
  static void trained_base(const std::string& run) {
    auto config = tiny(3);
    config.run.checkpoint_every = 3;
    PriorTrainer(config, run).run();
  }
  static PriorTrainConfig tiny(int64_t steps) {
    PriorTrainConfig config;
    config.model = {.text_length = 6, .text_vocab_size = 24, .grid_size = 4, .image_vocab_size = 16, .layers = 2,
                    .width = 32, .heads = 2, .conv_kernel = 3, .dropout = 0.1};
    config.data.train = *data_ / "train";
    config.data.validation = *data_ / "validation";
    config.data.batch_size = 8;
    config.data.caption_dropout = 0.25;
    config.learning_rate = {.peak = 3e-3, .warmup_steps = 3, .decay = "cosine", .end = 1e-4};
    config.run = testing::quick_run(steps);
    config.run.validate_every = 4;
    config.optimizer.ema_decay = 0.8;
    return config;
  }
};

TEST_F(PriorTrainerTest, ResumedRunContinuesWithTheSameLosses) {
  testing::expect_exact_resume<PriorTrainer>(tiny(8));
}

TEST_F(PriorTrainerTest, LossGoesDownAndTheRunLoads) {
  ScratchDir runs;
  auto config = tiny(80);
  config.run.validate_every = 40;
  config.run.checkpoint_every = 80;
  PriorTrainer trainer(config, runs / "run");
  const auto untrained = trainer.validate();
  trainer.run();
  const auto trained = trainer.validate();
  EXPECT_LT(trained.image_loss, 0.5 * untrained.image_loss)
      << "validation image loss " << untrained.image_loss << " -> " << trained.image_loss;
  const auto lines = testing::training_lines(runs / "run", /*with_time=*/true);
  ASSERT_FALSE(lines.empty());
  for (const auto& [step, line] : lines) {
    EXPECT_GT(line.value("update_seconds", 0.0), 0.0) << "update " << step << ": " << line.dump();
  }
  auto loaded = models::load_trained_prior(runs / "run");
  EXPECT_EQ(loaded.config.layers, 2);
  torch::NoGradGuard no_grad;
  const auto tokens = torch::cat({torch::tensor({5, 3, 0, 0, 0, 0}), (torch::arange(16) + 5) % 16}).view({1, 22});
  const auto loss = models::prior_loss(loaded.model->forward(tokens), tokens, loaded.config);
  EXPECT_LT(loss.image.item<double>(), 0.5 * untrained.image_loss) << "the EMA weights are loaded";
}

TEST_F(PriorTrainerTest, Fp16AndBf16RunsEndNearTheFp32Run) {
  ScratchDir runs;
  auto final_loss = [&](const std::string& mode) {
    auto config = tiny(24);
    config.precision.mode = mode;
    PriorTrainer trainer(config, runs / mode);
    trainer.run();
    if (mode == "float16") {
      EXPECT_EQ(trainer.gradient_scaler()->skipped_updates(), 0);
    }
    return trainer.validate().loss;
  };
  const double fp32 = final_loss("float32");
  EXPECT_NEAR(final_loss("float16"), fp32, 0.03 * fp32);
  EXPECT_NEAR(final_loss("bfloat16"), fp32, 0.03 * fp32);
}

// distributed.sharding within_node on a job of one: the prior is kept as shards of one (the
// layout a machine's ranks share, nothing divided), so that one GPU gets what sharding gives
// a machine: 16-bit weights, the average swapped in block by block to validate, no whole
// copy. It trains as the whole model does; with bfloat16 weights it learns as fp32 weights do
// and resumes bit for bit; its checkpoint loads as a model.
TEST_F(PriorTrainerTest, OneRankShardedTrainsAsTheWholeModelAndHoldsSixteenBitWeights) {
  ScratchDir runs;
  auto whole_config = tiny(8);
  whole_config.run.validate_every = 8;
  // Without dropout: the whole run draws its validation copy's initial values from the
  // generator that draws the dropout masks, so its masks are others.
  whole_config.model.dropout = 0;
  auto sharded_config = whole_config;
  sharded_config.distributed.sharding = "within_node";
  PriorTrainer whole(whole_config, runs / "whole");
  whole.run();
  PriorTrainer sharded(sharded_config, runs / "sharded");
  sharded.run();
  for (const auto& parameter : sharded.model()->parameters()) {
    EXPECT_EQ(parameter.numel(), 0) << "the prior's own tensors are emptied: only its shards are held";
  }
  const auto whole_lines = testing::training_lines(runs / "whole");
  const auto sharded_lines = testing::training_lines(runs / "sharded");
  for (int64_t step : {1, 4, 8}) {
    EXPECT_NEAR(sharded_lines.at(step)["loss"].get<double>(), whole_lines.at(step)["loss"].get<double>(), 1e-5)
        << "update " << step;
  }
  EXPECT_NEAR(sharded.validate().loss, whole.validate().loss, 1e-5);
  EXPECT_TRUE(std::filesystem::exists(runs / "sharded/checkpoints/step-000000008/shard-00000-of-00001.safetensors"));
  {
    torch::NoGradGuard no_grad;
    const auto tokens = tokens_for_test();
    const auto from_shards = models::load_trained_prior(runs / "sharded").model->forward(tokens);
    const auto from_whole = models::load_trained_prior(runs / "whole").model->forward(tokens);
    EXPECT_LT((from_shards - from_whole).abs().max().item<double>(), 1e-4);
  }

  auto sixteen_bit = tiny(24);
  sixteen_bit.distributed.sharding = "within_node";
  sixteen_bit.precision.mode = "bfloat16";
  auto fp32_weights = sixteen_bit;
  sixteen_bit.precision.weights = "bfloat16";
  PriorTrainer bf16(sixteen_bit, runs / "bf16");
  bf16.run();
  PriorTrainer fp32(fp32_weights, runs / "fp32-weights");
  fp32.run();
  const double reference = fp32.validate().loss;
  EXPECT_NEAR(bf16.validate().loss, reference, 0.01 * reference);
  sixteen_bit.run.validate_every = 1000;
  testing::expect_exact_resume<PriorTrainer>(sixteen_bit);
}

TEST_F(PriorTrainerTest, InfInOneResblockSkipsTheUpdateAndDividesOnlyItsScale) {
  ScratchDir runs;
  auto config = tiny(1);
  config.precision.mode = "float16";
  config.run.validate_every = 100;
  std::vector<torch::Tensor> before;
  {
    PriorTrainer trainer(config, runs / "run");
    for (const auto& parameter : trainer.model()->parameters()) before.push_back(parameter.detach().clone());
    trainer.model()->resblocks()[3]->parameters()[0].register_hook(
        [](const torch::Tensor& gradient) { return torch::full_like(gradient, INFINITY); });
    trainer.run();
    EXPECT_TRUE(trainer.last_metrics().skipped);
    const auto parameters = trainer.model()->parameters();
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(parameters[i], before[i])) << "parameter " << i;
    const auto* scaler = trainer.gradient_scaler();
    for (size_t block = 0; block < scaler->groups(); ++block) {
      EXPECT_DOUBLE_EQ(scaler->scale(block), std::exp2(block == 3 ? 12.5 : 13.001)) << "resblock " << block;
    }
  }
  config.run.steps = 3;
  PriorTrainer resumed(config, runs / "run");
  resumed.run();
  EXPECT_FALSE(resumed.last_metrics().skipped);
  EXPECT_TRUE(std::isfinite(resumed.last_metrics().loss));
  EXPECT_EQ(resumed.gradient_scaler()->skipped_updates(), 1) << "the scales come back from the checkpoint";
  EXPECT_NEAR(resumed.gradient_scaler()->scale(3), std::exp2(12.502), 1e-9);
  EXPECT_FALSE(torch::equal(resumed.model()->parameters()[0], before[0])) << "training went on";
}

TEST_F(PriorTrainerTest, ResumedFp16RunWithCheckpointingContinuesWithTheSameLosses) {
  ScratchDir runs;
  auto config = tiny(8);
  config.precision.mode = "float16";
  config.precision.adam_moments = "bfloat16";
  config.checkpoint_activations_every = 1;
  // Cut back to update 3, still in the warmup, whose rates do not depend on `steps`.
  testing::expect_exact_resume<PriorTrainer>(config, runs);
  EXPECT_TRUE(testing::training_lines(runs / "whole").at(8).contains("grad_scale_median")) << "the scales are logged";
}

// Without dropout a GPU run starts from the CPU run's weights and sees its batches (caption
// dropout draws on the CPU), so their losses agree to float tolerance, resumed too.
TEST_F(PriorTrainerTest, AGpuRunFollowsTheCpuRunAndResumes) {
  auto config = tiny(6);
  config.model.dropout = 0.0;
  testing::expect_gpu_run_follows_cpu_run<PriorTrainer>(config, "loss", 1e-3);
}

TEST_F(PriorTrainerTest, ACudaDeviceWithoutAGpuIsRefusedBeforeAnythingIsWritten) {
  testing::expect_cuda_refused_without_a_gpu<PriorTrainer>(tiny(1), "prior training");
}

TEST_F(PriorTrainerTest, RefusesADatasetThatDoesNotFitTheModel) {
  ScratchDir runs;
  auto config = tiny(1);
  config.model.text_length = 8;
  EXPECT_THROW_WITH(PriorTrainer(config, runs / "a"), Error, "does not fit the model", "text_length 6 (model 8)");
  config = tiny(1);
  config.model.image_vocab_size = 8;
  EXPECT_THROW_WITH(PriorTrainer(config, runs / "b"), Error, "image vocabulary 16 (model 8)");
}

TEST_F(PriorTrainerTest, RefusesSixteenBitCheckpointedInputsInAFloat32Run) {
  ScratchDir runs;
  auto config = tiny(1);
  config.checkpoint_activations_every = 1;
  config.checkpointed_inputs = "bfloat16";
  EXPECT_THROW_WITH(PriorTrainer(config, runs / "a"), Error,
                    "prior training: checkpointed_inputs bfloat16 needs precision.mode bfloat16 or float16");
}

// init_from fine-tunes a trained prior: the run starts from its moving average, with a fresh
// optimizer and the run's own schedule, and a resumed run starts from its own checkpoint.
TEST_F(PriorTrainerTest, InitFromStartsFromTheTrainedWeightsAndResumesFromItsOwnCheckpoint) {
  ScratchDir runs;
  PriorTrainer(tiny(40), runs / "base").run();
  auto config = tiny(8);
  config.init_from = runs / "base";
  PriorTrainer tuned(config, runs / "tuned");
  const auto base = models::load_trained_prior(runs / "base");
  const auto base_weights = base.model->named_parameters();
  for (const auto& item : tuned.model()->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), base_weights[item.key()])) << item.key();
  }
  const double untrained = PriorTrainer(tiny(8), runs / "fresh").validate().image_loss;
  EXPECT_LT(tuned.validate().image_loss, 0.5 * untrained) << "its moving average starts from the trained weights";
  testing::expect_exact_resume<PriorTrainer>(config);
}

TEST_F(PriorTrainerTest, InitFromRefusesAnotherModelOrAMissingRunBeforeWritingAnything) {
  ScratchDir runs;
  PriorTrainer(tiny(2), runs / "base").run();
  auto config = tiny(1);
  config.init_from = runs / "base";
  config.model.conv_kernel = 5;
  EXPECT_THROW_WITH(PriorTrainer(config, runs / "a"), Error, "is another model", "model.conv_kernel 3 (run 5)");
  EXPECT_FALSE(std::filesystem::exists(runs / "a"));
  // What only training reads is the run's own: the weights mean the same.
  config = tiny(1);
  config.init_from = runs / "base";
  config.model.text_loss_weight = 0.0;
  config.model.dropout = 0.2;
  EXPECT_NO_THROW(PriorTrainer(config, runs / "training-only"));
  config = tiny(1);
  config.init_from = runs / "nowhere";
  EXPECT_THROW_WITH(PriorTrainer(config, runs / "b"), Error, "nowhere");
  EXPECT_FALSE(std::filesystem::exists(runs / "b"));
}

// optimizer.trainable freezes what no pattern names (here attention and MLP weights, as
// Emojich's recipe did): frozen weights end as they began and have no moments in the
// checkpoint; the rest trains, and the run resumes exactly.
TEST_F(PriorTrainerTest, FrozenParametersStayAsTheyWereAndHaveNoMoments) {
  ScratchDir runs;
  auto config = tiny(6);
  config.run.checkpoint_every = 6;
  config.optimizer.trainable = {"*embedding*", "to_logits.*", "resblocks.*norm.*"};
  PriorTrainer trainer(config, runs / "run");
  std::map<std::string, torch::Tensor> before;
  for (const auto& item : trainer.model()->named_parameters()) before[item.key()] = item.value().detach().clone();
  trainer.run();
  const auto trains = [](const std::string& name) {
    return name.find("embedding") != std::string::npos || name.rfind("to_logits.", 0) == 0 ||
           (name.rfind("resblocks.", 0) == 0 && name.find("norm.") != std::string::npos);
  };
  const auto checkpoint = io::load_checkpoint(runs / "run/checkpoints/step-000000006");
  int64_t frozen = 0;
  for (const auto& item : trainer.model()->named_parameters()) {
    const auto& name = item.key();
    const bool has_moments = checkpoint.state.count("adamw." + name + ".exp_avg") > 0;
    if (trains(name)) {
      EXPECT_FALSE(torch::equal(item.value(), before[name])) << name << " trains";
      EXPECT_TRUE(has_moments) << name;
    } else {
      ++frozen;
      EXPECT_TRUE(torch::equal(item.value(), before[name])) << name << " is frozen";
      EXPECT_FALSE(item.value().requires_grad()) << name;
      EXPECT_FALSE(has_moments) << name << ": no moments for a frozen parameter";
    }
  }
  EXPECT_EQ(frozen, 18) << "qkv, out, fc_in and fc_out, weight and bias, of 2 layers, and final_norm";

  auto resumed = tiny(8);
  resumed.optimizer.trainable = config.optimizer.trainable;
  testing::expect_exact_resume<PriorTrainer>(resumed);
  auto nothing = tiny(1);
  nothing.optimizer.trainable = {"resblocks.*.qkv.*", "decoder.*"};
  EXPECT_THROW_WITH(PriorTrainer(nothing, runs / "a"), Error, "pattern \"decoder.*\" matches no parameter");
}

// Low-rank adapters on a trained prior (init_from): only the adapters train, the base stays as
// it was; checkpoints hold the adapters, their average and moments, and refer to the base for
// the rest; the run resumes exactly; and its exports, merged or an adapter file loaded onto
// the base, are one model.
TEST_F(PriorTrainerTest, AdaptersTrainAloneAndExportMergedOrAlone) {
  ScratchDir runs;
  trained_base(runs / "base");
  auto config = tiny(6);
  config.run.checkpoint_every = 6;
  config.init_from = runs / "base";
  config.adapter = {.rank = 2, .alpha = 4, .targets = {"resblocks.*.qkv", "resblocks.*.fc_*"}};
  PriorTrainer trainer(config, runs / "adapted");
  std::map<std::string, torch::Tensor> before;
  for (const auto& item : trainer.model()->named_parameters()) before[item.key()] = item.value().detach().clone();
  EXPECT_EQ(before.count("resblocks.0.qkv.lora_A.weight"), 1u);
  trainer.run();
  for (const auto& item : trainer.model()->named_parameters()) {
    const bool adapter = models::is_adapter_tensor(item.key());
    EXPECT_EQ(torch::equal(item.value(), before[item.key()]), !adapter)
        << item.key() << (adapter ? " trains" : " is frozen");
  }

  const std::string directory = runs / "adapted/checkpoints/step-000000006";
  const auto own = io::read_safetensors(directory + "/model.safetensors").tensors;
  const auto parameters = trainer.model()->named_parameters();
  for (const auto& [name, tensor] : own) {
    EXPECT_TRUE(models::is_adapter_tensor(name) || !parameters.contains(name))
        << name << ": a frozen weight in the checkpoint, which should refer to its base";
  }
  EXPECT_EQ(models::adapter_tensors(own).size(), 12u) << "lora_A and lora_B of qkv, fc_in and fc_out in 2 layers";
  const auto checkpoint = io::load_checkpoint(directory);
  EXPECT_EQ(io::base_of(checkpoint),
            std::filesystem::absolute(runs / "base/checkpoints/step-000000003").lexically_normal().string());
  EXPECT_EQ(checkpoint.weights.size(), io::state_dict(*trainer.model()).size()) << "the base fills in the rest";
  for (const auto& [name, tensor] : checkpoint.state) {
    if (name.rfind("adamw.", 0) == 0 && name.find(".exp_avg") != std::string::npos) {
      EXPECT_NE(name.find("lora_"), std::string::npos) << name << ": moments for a frozen parameter";
    }
  }

  models::export_weights(runs / "adapted", runs / "merged");
  models::export_adapter(runs / "adapted", runs / "adapter.safetensors");
  auto merged = models::load_trained_prior(runs / "merged");
  auto from_run = models::load_trained_prior(runs / "adapted");
  auto base = models::load_trained_prior(runs / "base");
  const auto base_logits = base.model->forward(tokens_for_test());
  const auto adapter = models::load_adapter_file(runs / "adapter.safetensors");
  EXPECT_EQ(adapter.base, io::base_of(checkpoint));
  models::apply_adapter(*base.model, adapter, 1.0);
  {
    torch::NoGradGuard no_grad;
    const auto tokens = tokens_for_test();
    const auto expected = merged.model->forward(tokens);
    EXPECT_GT(testing::relative_error(base_logits, expected), 1e-4) << "the adapters changed the model";
    EXPECT_LT(testing::relative_error(from_run.model->forward(tokens), expected), 1e-5);
    EXPECT_LT(testing::relative_error(base.model->forward(tokens), expected), 1e-5) << "base + adapter = merged";
  }

  // From the adapter run, whose adapters are folded in as it loads: its checkpoint does not hold
  // the frozen weights as the model does, so the run refers to a copy of them in base/.
  auto again = tiny(3);
  again.run.checkpoint_every = 3;
  again.init_from = runs / "adapted";
  again.adapter = config.adapter;
  PriorTrainer(again, runs / "again").run();
  const auto second = io::load_checkpoint(runs / "again/checkpoints/step-000000003");
  EXPECT_EQ(io::base_of(second), runs / "again/base");
  const auto merged_weights = io::state_dict(*merged.model);
  for (const auto& [name, tensor] : merged_weights) {
    EXPECT_TRUE(torch::equal(second.weights.at(name).to(tensor.dtype()), tensor)) << name << ": the folded-in weights";
  }
  EXPECT_EQ(models::adapter_tensors(io::read_safetensors(runs / "again/checkpoints/step-000000003/model.safetensors")
                                        .tensors).size(), 12u);

  auto resumed = tiny(8);
  resumed.init_from = config.init_from;
  resumed.adapter = config.adapter;
  testing::expect_exact_resume<PriorTrainer>(resumed);
}

// Adapters in 16 bits: fp16 (the adapters' gradients under their resblock's scale) and bf16
// (with activation checkpointing) runs from a trained prior end near the fp32 run, the base
// untouched in each.
TEST_F(PriorTrainerTest, AdaptersTrainInFp16AndBf16NearFp32) {
  ScratchDir runs;
  trained_base(runs / "base");
  const auto base = io::inference_weights(io::load_checkpoint(runs / "base/checkpoints/step-000000003"));
  auto final_loss = [&](const std::string& mode) {
    auto config = tiny(16);
    config.init_from = runs / "base";
    config.adapter = {.rank = 4, .alpha = 8};
    config.learning_rate.peak = 1e-2;
    config.precision.mode = mode;
    // Checkpointed, the first block's input (frozen embeddings) needs no gradient; its adapters do.
    config.checkpoint_activations_every = mode == "bfloat16" ? 1 : 0;
    PriorTrainer trainer(config, runs / mode);
    const double before = trainer.validate().loss;
    trainer.run();
    if (mode == "float16") {
      EXPECT_EQ(trainer.gradient_scaler()->skipped_updates(), 0);
    }
    for (const auto& item : trainer.model()->named_parameters()) {
      if (!models::is_adapter_tensor(item.key())) {
        EXPECT_TRUE(torch::equal(item.value(), base.at(item.key()))) << mode << ": " << item.key() << " is frozen";
      }
    }
    const double after = trainer.validate().loss;
    EXPECT_LT(after, before) << mode << ": the adapters lower the loss";
    return after;
  };
  const double fp32 = final_loss("float32");
  EXPECT_NEAR(final_loss("float16"), fp32, 0.03 * fp32);
  EXPECT_NEAR(final_loss("bfloat16"), fp32, 0.03 * fp32);
}

// frozen_weights: the base's resblock matrices kept in 16 bits (vectors, the embeddings and
// the output layer stay fp32) train adapters as the fp32 base does, to the 16-bit rounding of
// the frozen weights; validation and the run's resume work on them; an fp32 run refuses them.
TEST_F(PriorTrainerTest, FrozenWeightsIn16BitsTrainAdaptersAsTheFp32BaseDoes) {
  ScratchDir runs;
  trained_base(runs / "base");
  auto config = tiny(12);
  config.init_from = runs / "base";
  config.adapter = {.rank = 4, .alpha = 8};
  config.learning_rate.peak = 1e-2;
  for (const char* mode : {"bfloat16", "float16"}) {
    config.precision.mode = mode;
    auto stored = config;
    stored.frozen_weights = mode;
    PriorTrainer whole(config, runs / (std::string(mode) + "-fp32-base"));
    whole.run();
    PriorTrainer halved(stored, runs / (std::string(mode) + "-16-bit-base"));
    const double before = halved.validate().loss;
    halved.run();
    for (const auto& item : halved.model()->named_parameters()) {
      const bool in_16_bits = item.key().starts_with("resblocks.") && !models::is_adapter_tensor(item.key()) &&
                              item.value().dim() == 2;
      const auto sixteen = std::string(mode) == "bfloat16" ? torch::kBFloat16 : torch::kFloat16;
      EXPECT_EQ(item.value().scalar_type(), in_16_bits ? sixteen : torch::kFloat32) << mode << ": " << item.key();
    }
    const double after = halved.validate().loss;
    EXPECT_LT(after, before) << mode;
    EXPECT_NEAR(after, whole.validate().loss, 0.02 * after) << mode;
  }
  auto resumed = tiny(8);
  resumed.init_from = config.init_from;
  resumed.adapter = config.adapter;
  resumed.precision.mode = "bfloat16";
  resumed.frozen_weights = "bfloat16";
  testing::expect_exact_resume<PriorTrainer>(resumed);

  auto fp32 = config;
  fp32.precision.mode = "float32";
  fp32.frozen_weights = "float16";
  EXPECT_THAT([&] { PriorTrainer(fp32, runs / "refused"); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::HasSubstr("frozen_weights float16 needs precision.mode bfloat16 or float16")));
}

// data.retention tells a fine-tuning run what it forgets: a base trained on one mapping of
// captions to images, fine-tuned on another for the same captions, says so in metrics.jsonl
// (retention_loss before the first update and at each validation, forgetting its rise), and
// replaying the old images with the new ones forgets less.
TEST_F(PriorTrainerTest, RetentionLossSaysWhatAFineTuningRunForgetsAndReplayForgetsLess) {
  ScratchDir runs;
  PriorTrainer(tiny(60), runs / "base").run();
  write_token_dataset(runs / "new-train", 64, 3, /*stride=*/3);
  write_token_dataset(runs / "new-validation", 16, 4, /*stride=*/3);
  {  // the new images and as many old ones, replayed
    data::TokenDatasetWriter writer(runs / "new-and-old", {.image_vocab_size = 16, .text_vocab_size = 24,
                                                        .grid_height = 4, .grid_width = 4, .text_length = 6,
                                                        .source = "synthetic"});
    for (const auto& folder : {runs / "new-train", *data_ / "train"}) {
      auto set = data::TokenDataset::open(folder);
      std::mt19937_64 rng(0);
      for (size_t i = 0; i < set->size(); ++i) {
        const auto example = set->get(i, rng);
        writer.add(example->image_tokens, example->text_tokens.view({1, 6}), {example->caption});
      }
    }
    writer.finish();
  }
  const auto forgetting = [&](const std::string& train, const std::string& run) {
    auto config = tiny(20);
    config.init_from = runs / "base";
    config.data.train = train;
    config.data.validation = runs / "new-validation";
    config.data.retention = *data_ / "validation";
    config.run.validate_every = 10;
    PriorTrainer trainer(config, runs / run);
    trainer.run();
    std::vector<nlohmann::json> retained;
    std::ifstream metrics(runs / run + "/metrics.jsonl");
    for (std::string text; std::getline(metrics, text);) {
      auto line = nlohmann::json::parse(text);
      if (line.contains("retention_loss")) retained.push_back(std::move(line));
    }
    EXPECT_EQ(retained.size(), 3u) << "before the first update, at 10 and at 20";
    EXPECT_EQ(retained.front()["step"], 0);
    EXPECT_EQ(retained.front()["forgetting"], 0.0);
    const auto last = trainer.validate();
    EXPECT_NEAR(last.forgetting, last.retention_loss - retained.front()["retention_loss"].get<double>(), 1e-9);
    return retained.back()["forgetting"].get<double>();
  };
  const double alone = forgetting(runs / "new-train", "alone");
  const double replayed = forgetting(runs / "new-and-old", "replayed");
  EXPECT_GT(alone, 0.5) << "new images for the same captions: the old ones are forgotten";
  EXPECT_LT(replayed, 0.5 * alone) << "replay keeps them";
}

// keep_best: a run whose validation image loss rises (fine-tuned away from what it is validated on)
// keeps the checkpoint of its best validation beside the latest ones, and that one is the
// run's model: loaded, exported, started from.
TEST_F(PriorTrainerTest, KeepBestKeepsTheBestValidationsCheckpointAndItIsTheOneExported) {
  ScratchDir runs;
  PriorTrainer(tiny(60), runs / "base").run();
  write_token_dataset(runs / "new-train", 64, 3, /*stride=*/3);
  auto config = tiny(20);
  config.init_from = runs / "base";
  config.data.train = runs / "new-train";
  config.run.validate_every = 5;
  config.run.checkpoint_every = 3;
  config.run.keep_checkpoints = 2;
  config.keep_best = true;
  PriorTrainer(config, runs / "tuned").run();
  std::map<int64_t, double> validation;
  std::ifstream metrics(runs / "tuned/metrics.jsonl");
  for (std::string text; std::getline(metrics, text);) {
    const auto line = nlohmann::json::parse(text);
    if (line.contains("validation_image_loss")) validation[line["step"]] = line["validation_image_loss"];
  }
  ASSERT_EQ(validation.size(), 4u);
  const auto best = std::min_element(validation.begin(), validation.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
  ASSERT_LT(best->first, 20) << "the validation image loss rises: the best is not the last";
  char name[32];
  std::snprintf(name, sizeof name, "step-%09lld", static_cast<long long>(best->first));
  const auto kept = runs / ("tuned/checkpoints/" + std::string(name));
  EXPECT_TRUE(std::filesystem::exists(kept + "/model.safetensors")) << "pruning keeps the best";
  EXPECT_TRUE(std::filesystem::exists(runs / "tuned/checkpoints/step-000000020")) << "and the latest";
  EXPECT_EQ(io::resolve_checkpoint(runs / "tuned", "prior"), kept);
  const auto exported = models::export_weights(runs / "tuned", runs / "exported");
  EXPECT_EQ(exported.checkpoint, kept);
  const auto from_run = io::inference_weights(io::load_checkpoint(kept));
  for (const auto& [key, tensor] : io::inference_weights(io::load_checkpoint(runs / "exported"))) {
    if (from_run.count(key)) {
      EXPECT_TRUE(torch::equal(tensor, from_run.at(key))) << key;
    }
  }
  config.data.validation.clear();
  EXPECT_THROW_WITH(PriorTrainer(config, runs / "no-validation"), Error, "keep_best");
}

TEST(PriorLearningRate, WarmupThenCosineOrPlateau) {
  PriorLearningRate rate{.peak = 1.0, .warmup_steps = 10, .decay = "cosine", .end = 0.1};
  EXPECT_DOUBLE_EQ(rate.at(0, 110, 0), 0.1);
  EXPECT_DOUBLE_EQ(rate.at(9, 110, 0), 1.0);
  EXPECT_NEAR(rate.at(60, 110, 0), 0.55, 1e-12);
  EXPECT_NEAR(rate.at(110, 110, 0), 0.1, 1e-12);
  rate.decay = "plateau";
  EXPECT_DOUBLE_EQ(rate.at(50, 110, 2), 0.25);
}

}  // namespace
}  // namespace dalle::train
