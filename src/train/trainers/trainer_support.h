#pragma once
// What the trainers on image datasets (dVAE, VQGAN, super-resolution, CLIP) share beyond
// the driver (train/trainer_state.h): their images and loader, batches that never come back
// empty, the loop of those that need no captions, and the image tokenizers' validation
// with a reconstruction grid. Private to the library.
#include <torch/types.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/loader.h"
#include "dalle/io/safetensors.h"
#include "dalle/models/image_tokenizer.h"
#include "dalle/train/trainers/tokenizer_validation.h"
#include "train/run_directory.h"
#include "train/trainer_state.h"
#include "train/training_loop.h"

namespace dalle::train::detail {

// A tokenizer trainer's images: the training set (random crops if asked) behind a seeded
// loader, and the validation set.
struct ImageData {
  std::shared_ptr<data::ImageCaptionDataset> train, validation;
  std::unique_ptr<data::DataLoader<data::ImageCaptionDataset>> loader;
};
ImageData open_image_data(const data::ImageDataConfig& config, int64_t rank_batch, data::SamplerOptions shard);

torch::Tensor stack_images(const std::vector<data::ImageCaptionExample>& examples);

// The next batch with at least one image; throws after a whole epoch of unreadable ones.
data::Batch<data::ImageCaptionExample> next_nonempty_batch(ImageData& images);
// Its images stacked, for the trainers that need no captions.
torch::Tensor next_image_batch(ImageData& images);

// A trainer on an image dataset: its images, the loader position it checkpoints, and
// grid_images among the keys a resume may change.
template <class Config, class Model>
struct ImageTrainerState : TrainerState<Config, Model> {
  using TrainerState<Config, Model>::TrainerState;
  ImageData images;

  void open_images() {
    images = open_image_data(this->config.data, this->rank_batch(this->config.data.batch_size), this->shard());
  }
  data::LoaderPosition loader_position() const override { return images.loader->position(); }
  void seek_loader(const data::LoaderPosition& position) override { images.loader->seek(position); }
  bool may_change_on_resume(const std::string& key) const override {
    return is_run_control_key(key) || key == "grid_images";
  }
};

// The loop of a trainer whose State trains on batches of images alone (dVAE, VQGAN,
// super-resolution): State::train_step(images) returns Metrics with a `loss`, which
// State::log_step writes; `validate` validates and reports, given the update's metrics.
template <class Metrics, class State>
void run_image_training_loop(State& s, const std::function<void(const Metrics&)>& validate) {
  Metrics metrics;
  run_training_loop(s, intervals_of(s.config.run),
                    {.update =
                         [&] {
                           metrics = s.train_step(next_image_batch(s.images));
                           return metrics.loss;
                         },
                     .log = [&] { s.log_step(metrics); },
                     .validate = [&] { validate(metrics); },
                     .checkpoint = [&] { s.save_checkpoint(); }});
}

// PSNR of decode(encode(x)) and codebook usage over the first 256 validation images; writes
// original | reconstruction pairs to run/samples/step-N.png and a line to the metrics log,
// where `record` writes files.
TokenizerValidation validate_tokenizer(models::ImageTokenizer& tokenizer, const data::ImageCaptionDataset& images,
                                       int64_t batch_size, int64_t grid_images, const RunRecord& record);

// The log line of a tokenizer validation after update `step`, whose training loss was `loss`.
void log_tokenizer_validation(const std::string& what, int64_t step, double loss,
                              const TokenizerValidation& validation);

}  // namespace dalle::train::detail
