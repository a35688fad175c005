#pragma once
// What every trainer's tests share: its metrics lines, and the exact-resume check that a run
// stopped, cut back to an earlier checkpoint and resumed ends exactly as a run never stopped.
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/fashion_compose.h"
#include "dalle/io/checkpoint.h"
#include "dalle/text/tokenizer.h"
#include "dalle/train/recipe.h"
#include "test_support.h"

namespace dalle::testing {

// A trainer test's run: `steps` updates, a metrics line each, a checkpoint every 3, no
// validation before the last update.
inline train::RunConfig quick_run(int64_t steps) {
  return {.steps = steps, .log_every = 1, .validate_every = 1000, .checkpoint_every = 3};
}

// A caption tokenizer trained on the first caption of every image of `dataset`.
inline void train_caption_tokenizer(const std::string& dataset, const std::string& out, int64_t vocab_size,
                                    int64_t text_length) {
  const auto images = data::ImageCaptionDataset::open(dataset);
  std::vector<std::string> captions;
  for (size_t i = 0; i < images->size(); ++i) captions.push_back(images->record(i).captions[0]);
  text::TokenizerConfig config;
  config.vocab_size = vocab_size;
  config.text_length = text_length;
  text::Tokenizer::train(captions, config, out);
}

// A suite whose tests share datasets: its scratch folder `data_` lives from its first test
// to its last.
class TrainerSuite : public ::testing::Test {
 protected:
  static void TearDownTestSuite() {
    delete data_;
    data_ = nullptr;
  }
  static void make_data() { data_ = new ScratchDir(); }
  // A small fashion-compose dataset in data_/fc (train and test, nothing held out).
  static void compose_data(int64_t train_images, int64_t test_images) {
    make_data();
    data::FashionComposeConfig compose;
    compose.train_images = train_images;
    compose.test_images = test_images;
    compose.heldout_images = 0;
    data::build_fashion_compose(compose, *data_ / "fc");
  }

  static inline ScratchDir* data_ = nullptr;
};

// update -> the metrics line of each update that logged a training loss, without its wall
// time (`update_seconds`, which no rerun repeats) unless `with_time`; an update logged twice
// fails the test.
inline std::map<int64_t, nlohmann::json> training_lines(const std::string& run, bool with_time = false) {
  std::map<int64_t, nlohmann::json> out;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto entry = nlohmann::json::parse(line);
    if (!entry.contains("loss")) continue;
    if (!with_time) entry.erase("update_seconds");
    const bool first = out.emplace(entry["step"].get<int64_t>(), entry).second;
    EXPECT_TRUE(first) << "update " << entry["step"] << " logged twice in " << run;
  }
  return out;
}

// The mean of `key` over the lines of updates `first` to `last`, both included.
inline double mean_metric(const std::map<int64_t, nlohmann::json>& lines, const std::string& key, int64_t first,
                          int64_t last) {
  double sum = 0;
  for (int64_t step = first; step <= last; ++step) sum += lines.at(step).at(key).get<double>();
  return sum / static_cast<double>(last - first + 1);
}

// A run of `config` trained to its end without checkpoints in a scratch folder: the trainer,
// its validation before the first update and its metrics lines.
template <class Trainer>
struct LearningRun {
  template <class Config>
  explicit LearningRun(const Config& config)
      : trainer(checkpointed_at_the_end(config), runs / "run"), untrained(trainer.validate()) {
    trainer.run();
    lines = training_lines(runs / "run");
  }

  template <class Config>
  static Config checkpointed_at_the_end(Config config) {
    config.run.checkpoint_every = config.run.steps;
    return config;
  }

  ScratchDir runs;
  Trainer trainer;
  decltype(std::declval<Trainer&>().validate()) untrained;
  std::map<int64_t, nlohmann::json> lines;
};

// Trains `config` (which checkpoints every 3 updates and logs every update) for 8 updates
// whole, and for 4 then resumed from the checkpoint at update 3. Every update's metrics line
// and the last checkpoint's tensors (weights, moving average, moments, generators, scales)
// must agree bit for bit. The two runs are `runs`/whole and `runs`/interrupted.
template <class Trainer, class Config>
void expect_exact_resume(const Config& config, const ScratchDir& runs = ScratchDir()) {
  auto whole = config, half = config;
  whole.run.steps = 8;
  half.run.steps = 4;
  // One thread count for both runs: with 0 each would take the cores idle at its start, which
  // the machine's load changes, and CPU sums differ with it in their last bits.
  if (config.run.threads == 0) whole.run.threads = half.run.threads = 2;
  EXPECT_EQ(config.run.checkpoint_every, 3);
  EXPECT_EQ(config.run.log_every, 1);
  Trainer(whole, runs / "whole").run();
  Trainer(half, runs / "interrupted").run();  // checkpoints at 3 and 4
  std::filesystem::remove_all(runs / "interrupted/checkpoints/step-000000004");
  write_text(runs / "interrupted/checkpoints/latest", "step-000000003\n");
  Trainer resumed(whole, runs / "interrupted");
  EXPECT_EQ(resumed.step(), 3);
  resumed.run();

  const auto lines = training_lines(runs / "whole");
  EXPECT_EQ(lines.size(), 8u);
  EXPECT_EQ(training_lines(runs / "interrupted"), lines) << "every update's metrics, bit for bit, none twice";
  const auto a = io::load_checkpoint(runs / "whole/checkpoints/step-000000008");
  const auto b = io::load_checkpoint(runs / "interrupted/checkpoints/step-000000008");
  for (const auto& [name, tensor] : a.weights) EXPECT_TRUE(torch::equal(tensor, b.weights.at(name))) << name;
  EXPECT_EQ(a.state.size(), b.state.size());
  for (const auto& [name, tensor] : a.state) {
    const auto other = b.state.find(name);
    EXPECT_TRUE(other != b.state.end() && torch::equal(tensor, other->second)) << name;
  }
}

}  // namespace dalle::testing
