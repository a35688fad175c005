#include "dalle/models/item_classifier.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>

#include "dalle/error.h"
#include "dalle/config.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/model_config.h"

namespace dalle::models {

ItemClassifierImpl::ItemClassifierImpl(const ItemClassifierConfig& config) {
  if (config.channels.empty()) throw Error("item classifier: `channels` needs at least one conv block");
  int64_t in = 1, side = kClassifierInputSize;
  for (const int64_t out : config.channels) {
    if (side < 2) throw Error("item classifier: too many conv blocks for a 28x28 input");
    convs_->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)));
    convs_->push_back(torch::nn::ReLU());
    convs_->push_back(torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)));
    in = out;
    side /= 2;
  }
  register_module("convs", convs_);
  feature_ = register_module("feature", torch::nn::Linear(in * side * side, config.features));
  head_ = register_module("head", torch::nn::Linear(config.features, 10));
}

torch::Tensor ItemClassifierImpl::features(const torch::Tensor& x) {
  return torch::relu(feature_(convs_->forward(x).flatten(1)));
}

torch::Tensor ItemClassifierImpl::head(const torch::Tensor& features) { return head_(features); }

TrainedClassifier load_item_classifier(const std::string& directory) {
  if (!std::filesystem::exists(std::filesystem::path(directory) / io::kWeightsFile)) {
    throw Error(directory + ": not an item classifier directory (no " + io::kWeightsFile + "; train one with "
                "`dalle-eval train-classifier --out " + directory + "`)");
  }
  const auto checkpoint = io::load_checkpoint(directory);
  if (checkpoint.state_metadata.count("kind") == 0 || checkpoint.state_metadata.at("kind") != "item_classifier") {
    throw Error(directory + ": not an item classifier checkpoint (its state.safetensors says kind '" +
                (checkpoint.state_metadata.count("kind") ? checkpoint.state_metadata.at("kind") : "") + "')");
  }
  ItemClassifierConfig config;
  const auto source = ConfigSource::from_string(checkpoint.config_yaml, directory + "/config.yaml");
  bind_config_parts(source, [&config](ConfigVisitor& v) { v.section("model", "", config); }, {"model"});
  require_model_sizes<ItemClassifierConfig>(source);
  TrainedClassifier trained{ItemClassifier(config), config, 0.0};
  io::load_state_dict(*trained.model, checkpoint.weights, directory + "/" + io::kWeightsFile);
  trained.model->eval();
  if (checkpoint.state_metadata.count("test_accuracy")) {
    trained.test_accuracy = std::stod(checkpoint.state_metadata.at("test_accuracy"));
  }
  return trained;
}

Classified classify(ItemClassifier& model, const torch::Tensor& inputs, int64_t batch_size) {
  torch::NoGradGuard no_grad;
  const bool training = model->is_training();
  model->eval();
  std::vector<torch::Tensor> features, probabilities;
  for (int64_t first = 0; first < inputs.size(0); first += batch_size) {
    const auto batch = inputs.slice(0, first, std::min(inputs.size(0), first + batch_size)).to(torch::kFloat32);
    auto f = model->features(batch);
    probabilities.push_back(torch::softmax(model->head(f), 1));
    features.push_back(f);
  }
  model->train(training);
  Classified result;
  result.features = features.empty() ? torch::zeros({0, 0}) : torch::cat(features);
  result.probabilities = probabilities.empty() ? torch::zeros({0, 10}) : torch::cat(probabilities);
  result.labels = result.probabilities.size(0) ? result.probabilities.argmax(1) : torch::zeros({0}, torch::kInt64);
  return result;
}

}  // namespace dalle::models
