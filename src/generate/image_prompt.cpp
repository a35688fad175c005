#include "dalle/generate/image_prompt.h"

#include <torch/torch.h>

#include "dalle/data/image.h"
#include "dalle/error.h"

namespace dalle::generate {

void ImagePromptConfig::visit(ConfigVisitor& v) {
  v.field("image", image,
          "image file whose tokens every sample keeps where top_rows or mask says, the rest drawn to fit them and "
          "the caption (ruDALL-E's image prompts); empty: none");
  v.field("top_rows", top_rows, "token rows of the image kept from the top (with image; or mask)",
          {.min = 0, .max = 256});
  v.field("mask", mask,
          "image file marking the kept tokens in white, any size, scaled and cropped as the image is: a token is "
          "kept where its cell averages at least half white (with image; or top_rows)");
}

void ImagePromptConfig::validate() const {
  const bool rows = top_rows > 0, masked = !mask.empty();
  if (!enabled() && (rows || masked)) {
    throw Error("image_prompt: top_rows and mask say which tokens of image_prompt.image to keep; set the image");
  }
  if (enabled() && rows == masked) {
    throw Error("image_prompt: say which tokens of " + image + " to keep with top_rows or with mask (one of them)");
  }
}

namespace {

// As datasets prepare images: the shorter side scaled to `size`, the centre cropped square.
torch::Tensor square(const torch::Tensor& image, int64_t size) {
  return data::center_crop(data::resize_shorter_side(image, size), size, size);
}

torch::Tensor kept_positions(const ImagePromptConfig& config, int64_t image_size, int64_t grid) {
  if (config.top_rows > grid) {
    throw Error("image_prompt: top_rows " + std::to_string(config.top_rows) + " exceeds the token grid's " +
                std::to_string(grid) + " rows");
  }
  if (config.top_rows > 0) return torch::arange(grid * grid) < config.top_rows * grid;
  const auto whiteness = square(data::read_image(config.mask), image_size).mean(0, /*keepdim=*/true);
  const auto known = data::resize(whiteness, grid, grid).flatten() >= 0.5;
  if (!known.any().item<bool>()) {
    throw Error("image_prompt: the mask " + config.mask + " keeps no token (white marks the kept cells)");
  }
  return known;
}

}  // namespace

models::ImagePrompt load_image_prompt(const ImagePromptConfig& config, models::TrainedImageTokenizer& tokenizer) {
  config.validate();
  const int64_t grid = tokenizer.grid_size();
  auto known = kept_positions(config, tokenizer.image_size, grid);
  const auto device = tokenizer.model->module().parameters().front().device();
  const auto image = square(data::read_image(config.image), tokenizer.image_size).unsqueeze(0).to(device);
  torch::NoGradGuard no_grad;
  const auto tokens = tokenizer.model->encode_tokens(image).reshape({1, grid * grid}).cpu();
  return {.tokens = tokens, .known = std::move(known)};
}

}  // namespace dalle::generate
