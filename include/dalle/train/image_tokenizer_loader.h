#pragma once
// Loads a trained image tokenizer of either kind from a run or checkpoint directory: the
// checkpoint's config.yaml says which (`kind: dvae`, the default, or `kind: vqgan`).
#include <cstdint>
#include <memory>
#include <string>

#include <torch/types.h>

#include "dalle/models/image_tokenizer.h"

namespace dalle::train {

struct TrainedImageTokenizer {
  std::string kind;  // "dvae" or "vqgan"
  std::shared_ptr<models::ImageTokenizer> model;  // in eval mode, EMA weights where saved
  int64_t image_size = 0;                         // the side it was trained at
  int64_t grid_size() const { return image_size / model->downsampling_factor(); }
};

TrainedImageTokenizer load_image_tokenizer(const std::string& run_or_checkpoint);

// [B, C, S, S] images in [0, 1], S the tokenizer's image_size -> the same images encoded to
// tokens and decoded again, clamped to [0, 1]: what a perfect prior drawing through this
// tokenizer could show. Without gradients; on the images' device.
torch::Tensor round_trip(TrainedImageTokenizer& tokenizer, const torch::Tensor& images);

}  // namespace dalle::train
