#pragma once
// What the trainers on image datasets (dVAE, VQGAN, super-resolution, CLIP) share beyond
// run_directory.h: the keys a resume may change, batches that never come back empty, the
// AdamW they build, the loop of those that need no captions, and the image tokenizers'
// validation with a reconstruction grid. Private to the library.
#include <torch/types.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/loader.h"
#include "dalle/io/safetensors.h"
#include "dalle/models/image_tokenizer.h"
#include "dalle/train/adamw.h"
#include "dalle/train/trainers/dvae_trainer.h"
#include "dalle/train/trainers/tokenizer_validation.h"
#include "train/run_directory.h"
#include "train/training_loop.h"

namespace dalle::train::detail {

// Keys that may change when a run resumes: how long and how often, not what is trained.
bool may_change_on_resume(const std::string& key);

// A tokenizer trainer's images: the training set (random crops if asked) behind a seeded
// loader, and the validation set.
struct ImageData {
  std::shared_ptr<data::ImageCaptionDataset> train, validation;
  std::unique_ptr<data::DataLoader<data::ImageCaptionDataset>> loader;
};
ImageData open_image_data(const data::ImageDataConfig& config, int64_t seed);

torch::Tensor stack_images(const std::vector<data::ImageCaptionExample>& examples);

// The next batch with at least one image; throws after a whole epoch of unreadable ones.
data::Batch<data::ImageCaptionExample> next_nonempty_batch(ImageData& images);
// Its images stacked, for the trainers that need no captions.
torch::Tensor next_image_batch(ImageData& images);

// The loop of a trainer whose State trains on batches of images alone (dVAE, VQGAN,
// super-resolution): State::train_step(images) returns Metrics with a `loss`, which
// State::log_step writes; `validate` validates and reports, given the update's metrics.
template <class Metrics, class State>
void run_image_training_loop(State& s, const std::function<void(const Metrics&)>& validate) {
  Metrics metrics;
  run_training_loop(s, intervals_of(s.config),
                    {.update =
                         [&] {
                           metrics = s.train_step(next_image_batch(s.images));
                           return metrics.loss;
                         },
                     .log = [&] { s.log_step(metrics); },
                     .validate = [&] { validate(metrics); },
                     .checkpoint = [&] { s.save_checkpoint(); }});
}

// AdamW over `parameters` with the config's betas, epsilon, weight decay and first learning
// rate, its moments kept in the config's precision.
template <class Config>
std::unique_ptr<AdamW> make_adamw(const std::vector<torch::Tensor>& parameters, const Config& config) {
  return std::make_unique<AdamW>(std::vector{torch::optim::OptimizerParamGroup(parameters)},
                                 torch::optim::AdamWOptions(config.learning_rate.at(0))
                                     .betas({config.beta1, config.beta2})
                                     .eps(config.epsilon)
                                     .weight_decay(config.weight_decay),
                                 config.precision.moments_dtype());
}

// PSNR of decode(encode(x)) and codebook usage over the first 256 validation images; writes
// original | reconstruction pairs to run/samples/step-N.png and a line to the metrics log.
TokenizerValidation validate_tokenizer(models::ImageTokenizer& tokenizer, const data::ImageCaptionDataset& images,
                                       int64_t batch_size, int64_t grid_images, int64_t step,
                                       const std::filesystem::path& run, const MetricsLog& metrics,
                                       const std::string& what);

// The log line of a tokenizer validation after update `step`, whose training loss was `loss`.
void log_tokenizer_validation(const std::string& what, int64_t step, double loss,
                              const TokenizerValidation& validation);

}  // namespace dalle::train::detail
