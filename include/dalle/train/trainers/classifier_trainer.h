#pragma once
// Trains the item classifier on Fashion-MNIST (Debian's dataset-fashion-mnist): Adam with a
// cosine decay, cross-entropy, a seeded shuffle per epoch and a random shift of up to `shift` pixels,
// then measures its accuracy on the test split and saves it as a checkpoint directory.
// A seed (and thread count) fixes the result on the CPU.
#include <cstdint>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/data/fashion_mnist.h"
#include "dalle/models/item_classifier.h"

namespace dalle::train {

struct ClassifierTrainConfig {
  models::ItemClassifierConfig model;
  int64_t epochs = 5;
  int64_t batch_size = 64;
  double learning_rate = 1e-3;
  bool cosine_decay = true;
  int64_t shift = 1;
  int64_t train_limit = 0;
  int64_t test_limit = 0;
  int64_t seed = 0;
  int64_t threads = 0;
  std::string source = data::kFashionMnistDir;

  void visit(ConfigVisitor& v) {
    v.section("model", "the classifier's layers", model);
    v.field("epochs", epochs, "passes over the training items", {.min = 1, .max = 1000});
    v.field("batch_size", batch_size, "items per Adam update", {.min = 1, .max = 65536});
    v.field("learning_rate", learning_rate, "Adam's step size (at the start, with cosine_decay)",
            {.min = 0.0, .max = 1.0});
    v.field("cosine_decay", cosine_decay, "lower the step size along a half cosine to 0 at the last update");
    v.field("shift", shift, "largest random shift of a training item, in pixels (0: none)", {.min = 0, .max = 8});
    v.field("train_limit", train_limit, "train on the first N Fashion-MNIST train items (0: all 60,000)",
            {.min = 0});
    v.field("test_limit", test_limit, "measure accuracy on the first N test items (0: all 10,000)", {.min = 0});
    v.field("seed", seed, "random seed: initialisation, order and shifts", {.min = 0});
    v.field("threads", threads, "torch intra-op threads (0: one per idle core)", {.min = 0, .max = 1024});
    v.field("source", source, "folder of the Fashion-MNIST idx files");
  }
};

struct ClassifierTrainResult {
  double test_accuracy = 0;
  std::vector<double> epoch_losses;  // mean training loss of each epoch
  int64_t train_items = 0, test_items = 0;
  double seconds = 0;
};

// Trains and writes `out` (config.yaml, model.safetensors, state.safetensors whose metadata
// holds the test accuracy), atomically: `out` is replaced only by a complete directory.
// Refuses an `out` that exists and is not an item-classifier directory.
ClassifierTrainResult train_item_classifier(const ClassifierTrainConfig& config, const std::string& out);

// Fraction of `items` ([N, 28, 28] uint8 Fashion-MNIST pictures) whose class comes out as
// `labels`, each framed by data::classifier_input first.
double classifier_accuracy(models::ItemClassifier& model, const data::FashionMnist& items);

// data::classifier_input of every item: [N, 1, 28, 28] float.
torch::Tensor classifier_inputs(const torch::Tensor& items);

}  // namespace dalle::train
