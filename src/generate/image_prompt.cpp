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

torch::Tensor square_image(const torch::Tensor& image, int64_t size) {
  return data::center_crop(data::resize_shorter_side(image, size), size, size);
}

namespace {

torch::Tensor kept_positions(const ImagePromptConfig& config, int64_t image_size, int64_t grid) {
  if (config.top_rows > grid) {
    throw Error("image_prompt: top_rows " + std::to_string(config.top_rows) + " exceeds the token grid's " +
                std::to_string(grid) + " rows");
  }
  if (config.top_rows > 0) return torch::arange(grid * grid) < config.top_rows * grid;
  const auto whiteness = square_image(data::read_image(config.mask), image_size).mean(0, /*keepdim=*/true);
  const auto known = data::resize(whiteness, grid, grid).flatten() >= 0.5;
  if (!known.any().item<bool>()) {
    throw Error("image_prompt: the mask " + config.mask + " keeps no token (white marks the kept cells)");
  }
  return known;
}

// The image's tokens [1, grid * grid] under `tokenizer`.
torch::Tensor tokens_of(const torch::Tensor& image, models::TrainedImageTokenizer& tokenizer) {
  const int64_t grid = tokenizer.grid_size();
  const auto device = tokenizer.model->module().parameters().front().device();
  torch::NoGradGuard no_grad;
  const auto squared = square_image(image, tokenizer.image_size).unsqueeze(0).to(device);
  return tokenizer.model->encode_tokens(squared).reshape({1, grid * grid}).cpu();
}

}  // namespace

std::optional<int64_t> top_rows_kept(const torch::Tensor& alpha, int64_t image_size, int64_t grid) {
  const auto opaque = data::resize(square_image(alpha, image_size), grid, grid)[0] >= 0.5;  // [grid, grid]
  const auto whole_rows = opaque.all(1), empty_rows = opaque.logical_not().all(1);
  const auto rows = whole_rows.to(torch::kInt64).cumprod(0).sum().item<int64_t>();  // leading whole rows
  if (rows == 0 || rows == grid) return std::nullopt;
  if (!empty_rows.slice(0, rows).all().item<bool>()) return std::nullopt;
  return rows;
}

models::ImagePrompt load_image_prompt(const ImagePromptConfig& config, models::TrainedImageTokenizer& tokenizer) {
  config.validate();
  auto known = kept_positions(config, tokenizer.image_size, tokenizer.grid_size());
  return {.tokens = tokens_of(data::read_image(config.image), tokenizer), .known = std::move(known)};
}

models::ImagePrompt encode_image_prompt(const PromptImage& prompt, models::TrainedImageTokenizer& tokenizer) {
  const int64_t grid = tokenizer.grid_size();
  if (prompt.top_rows < 1 || prompt.top_rows >= grid) {
    throw Error("image prompt: top_rows " + std::to_string(prompt.top_rows) + " must leave rows to draw of the " +
                std::to_string(grid) + "-row token grid (1 to " + std::to_string(grid - 1) + ")");
  }
  return {.tokens = tokens_of(prompt.image, tokenizer), .known = torch::arange(grid * grid) < prompt.top_rows * grid};
}

}  // namespace dalle::generate
