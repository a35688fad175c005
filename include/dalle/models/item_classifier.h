#pragma once
// The item classifier dalle-eval judges generated items with: a small CNN trained on
// Fashion-MNIST (28x28 grey items), whose penultimate layer is also the feature space FID is
// measured in. Its input is always made by data::classifier_input, for training items and
// for items cut out of generated images alike, so the two are framed the same way.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dalle/config.h"

namespace dalle::models {

// The side of its input, as data::classifier_input frames it (a test holds the two together).
inline constexpr int64_t kClassifierInputSize = 28;

struct ItemClassifierConfig {
  std::vector<int64_t> channels = {32, 64};  // one 3x3 conv + ReLU + 2x2 max-pool per entry
  int64_t features = 128;                    // width of the feature layer (FID's space)

  void visit(ConfigVisitor& v) {
    v.field("channels", channels, "output channels of each 3x3 conv block (each halves the side)",
            {.min = 1, .max = 1024});
    v.field("features", features, "width of the penultimate layer, the feature space FID is measured in",
            {.min = 2, .max = 4096});
  }
};

class ItemClassifierImpl : public torch::nn::Module {
 public:
  explicit ItemClassifierImpl(const ItemClassifierConfig& config);
  // [B, 1, 28, 28] inputs from data::classifier_input -> [B, features] (after ReLU).
  torch::Tensor features(const torch::Tensor& x);
  // [B, features] -> [B, 10] class logits.
  torch::Tensor head(const torch::Tensor& features);
  torch::Tensor forward(const torch::Tensor& x) { return head(features(x)); }

 private:
  torch::nn::Sequential convs_;
  torch::nn::Linear feature_{nullptr}, head_{nullptr};
};
TORCH_MODULE(ItemClassifier);

// A trained classifier directory (config.yaml + model.safetensors + state.safetensors, as
// train::train_item_classifier writes it); the model comes back in eval mode on the CPU.
struct TrainedClassifier {
  ItemClassifier model{nullptr};
  ItemClassifierConfig config;
  double test_accuracy = 0;  // measured on the Fashion-MNIST test split when it was trained
};
TrainedClassifier load_item_classifier(const std::string& directory);

// Logits and features of a stack of classifier inputs, in batches, without gradients.
struct Classified {
  torch::Tensor labels;    // [N] int64
  torch::Tensor features;  // [N, features] float32
  torch::Tensor probabilities;  // [N, 10]
};
Classified classify(ItemClassifier& model, const torch::Tensor& inputs, int64_t batch_size = 256);

}  // namespace dalle::models
