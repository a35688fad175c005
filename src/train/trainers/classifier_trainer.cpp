#include "dalle/train/trainers/classifier_trainer.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <random>
#include <sstream>

#include "dalle/data/classifier_input.h"
#include "dalle/data/sampler.h"
#include "dalle/error.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/log.h"
#include "dalle/runtime.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/update_step.h"

namespace dalle::train {
namespace fs = std::filesystem;

torch::Tensor classifier_inputs(const torch::Tensor& items) {
  TORCH_CHECK(items.dim() == 3, "classifier_inputs: expected [N, H, W] items, got ", items.sizes());
  const auto pictures = items.to(torch::kFloat32);
  auto inputs = torch::empty({items.size(0), 1, models::kClassifierInputSize, models::kClassifierInputSize});
  for (int64_t i = 0; i < items.size(0); ++i) inputs[i].copy_(data::classifier_input(pictures[i]));
  return inputs;
}

double classifier_accuracy(models::ItemClassifier& model, const data::FashionMnist& items) {
  if (items.images.size(0) == 0) throw Error("classifier accuracy: no items");
  const auto predicted = models::classify(model, classifier_inputs(items.images)).labels;
  return predicted.eq(items.labels).to(torch::kFloat64).mean().item<double>();
}

namespace {

data::FashionMnist first(const data::FashionMnist& items, int64_t limit) {
  if (limit <= 0 || limit >= items.images.size(0)) return items;
  return {items.images.slice(0, 0, limit), items.labels.slice(0, 0, limit)};
}

// Each item moved by up to `shift` pixels in x and y, the uncovered border black.
torch::Tensor shifted(const torch::Tensor& batch, int64_t shift, std::mt19937_64& rng) {
  if (shift == 0) return batch;
  const int64_t side = batch.size(-1);
  const auto padded = torch::constant_pad_nd(batch, {shift, shift, shift, shift});
  std::vector<torch::Tensor> rows;
  rows.reserve(static_cast<size_t>(batch.size(0)));
  for (int64_t i = 0; i < batch.size(0); ++i) {
    const auto dx = static_cast<int64_t>(rng() % static_cast<uint64_t>(2 * shift + 1));
    const auto dy = static_cast<int64_t>(rng() % static_cast<uint64_t>(2 * shift + 1));
    rows.push_back(padded[i].slice(1, dy, dy + side).slice(2, dx, dx + side));
  }
  return torch::stack(rows);
}

void check_output(const fs::path& out) {
  if (!fs::exists(out)) return;
  if (!fs::is_directory(out)) throw Error(out.string() + ": exists and is not a directory");
  if (fs::is_empty(out) || fs::exists(out / io::kWeightsFile)) return;
  throw Error(out.string() + ": exists and is not an item classifier directory; refusing to replace it");
}

}  // namespace

ClassifierTrainResult train_item_classifier(const ClassifierTrainConfig& config, const std::string& out) {
  const auto start = std::chrono::steady_clock::now();
  check_output(out);
  set_torch_threads(config.threads);
  const auto train = first(data::load_fashion_mnist("train", config.source), config.train_limit);
  const auto test = first(data::load_fashion_mnist("test", config.source), config.test_limit);
  const auto seed = static_cast<uint64_t>(config.seed);

  torch::manual_seed(seed);
  models::ItemClassifier model(config.model);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(config.learning_rate));
  ModelPrecision precision(PrecisionConfig{}, model->parameters());
  UpdateStep update(optimizer, precision, {.what = "classifier"});
  const auto inputs = classifier_inputs(train.images);
  const int64_t count = inputs.size(0);
  const data::ShardedSampler sampler(count, {.seed = seed, .shuffle = true});
  std::mt19937_64 rng(mix_seed(seed, 1));

  ClassifierTrainResult result;
  result.train_items = count;
  result.test_items = test.images.size(0);
  const int64_t batches = (count + config.batch_size - 1) / config.batch_size;
  log::Progress progress("classifier", config.epochs * batches);
  model->train();
  for (int64_t epoch = 0; epoch < config.epochs; ++epoch) {
    const auto order = torch::tensor(sampler.indices(epoch), torch::kInt64);
    double total = 0;
    for (int64_t b = 0; b < batches; ++b) {
      const auto rows = order.slice(0, b * config.batch_size, std::min(count, (b + 1) * config.batch_size));
      const auto batch = shifted(inputs.index_select(0, rows), config.shift, rng);
      if (config.cosine_decay) {
        const double done = static_cast<double>(epoch * batches + b) / static_cast<double>(config.epochs * batches);
        for (auto& group : optimizer.param_groups()) {
          group.options().set_lr(config.learning_rate * 0.5 * (1 + std::cos(M_PI * done)));
        }
      }
      const auto loss = torch::nn::functional::cross_entropy(model->forward(batch), train.labels.index_select(0, rows));
      update.apply(loss, epoch * batches + b + 1);
      const double value = loss.item<double>();
      total += value * static_cast<double>(rows.size(0));
      progress.set_loss(value);
      progress.advance();
    }
    result.epoch_losses.push_back(total / static_cast<double>(count));
    log::info("classifier: epoch ", epoch + 1, "/", config.epochs, " mean loss ", result.epoch_losses.back());
  }
  progress.finish();
  model->eval();
  result.test_accuracy = classifier_accuracy(model, test);
  log::info("classifier: test accuracy ", result.test_accuracy, " on ", result.test_items, " Fashion-MNIST test items");

  auto saved = config;
  std::ostringstream losses;
  for (size_t i = 0; i < result.epoch_losses.size(); ++i) losses << (i ? " " : "") << result.epoch_losses[i];
  io::Checkpoint checkpoint;
  checkpoint.config_yaml = config_to_yaml(visit_of(saved));
  checkpoint.weights = io::state_dict(*model);
  checkpoint.state_metadata = {{"kind", "item_classifier"},
                               {"test_accuracy", std::to_string(result.test_accuracy)},
                               {"test_items", std::to_string(result.test_items)},
                               {"train_items", std::to_string(result.train_items)},
                               {"epoch_losses", losses.str()}};
  io::save_checkpoint(out, checkpoint);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace dalle::train
