#pragma once
// ruDALL-E's image prompts ("continue this picture"): the tokens of a given image are fixed
// where the prompt keeps them (its top rows, or the cells a mask marks) and the prior samples
// the rest, conditioned on them and on the caption.
#include <cstdint>
#include <optional>
#include <string>

#include "dalle/config.h"
#include "dalle/models/prior_sampling.h"
#include "dalle/models/trained.h"

namespace dalle::generate {

struct ImagePromptConfig {
  std::string image;     // image file; empty: no image prompt
  int64_t top_rows = 0;  // token rows of the image kept from the top
  std::string mask;      // image file: a token is kept where its cell is mostly white

  void visit(ConfigVisitor& v);
  // Refuses a half-given prompt: rows or a mask without an image, an image with neither, or both.
  void validate() const;
  bool enabled() const { return !image.empty(); }
};

// As datasets prepare images, and image prompts are before they are encoded: the shorter side
// scaled to `size`, the centre cropped square. An image already `size` square is returned as is.
torch::Tensor square_image(const torch::Tensor& image, int64_t size);

// One request's image prompt, given as pixels (dalle-serve's POST /v1/images/edits): its top
// `top_rows` token rows are kept.
struct PromptImage {
  torch::Tensor image;  // [3, H, W] in [0, 1], any size: scaled and cropped as the config's image is
  int64_t top_rows = 0;
};

// The top token rows that an alpha mask ([1, H, W], 1 opaque) keeps, scaled and cropped as
// its image is to `image_size` pixels and a grid of `grid` rows: a cell is kept where it
// averages at least half opaque. Nothing when the kept cells are not whole rows from the top
// with some rows left to draw (a hole in the middle, say), which ruDALL-E's prompts cannot be.
std::optional<int64_t> top_rows_kept(const torch::Tensor& alpha, int64_t image_size, int64_t grid);

// The image's tokens under `tokenizer` (scaled so that its shorter side is the tokenizer's
// image_size, then centre-cropped, as datasets are) and the positions the prompt keeps; the
// mask is scaled and cropped as the image is. Throws naming the file that cannot be read, and
// on rows beyond the grid or a mask that keeps nothing.
models::ImagePrompt load_image_prompt(const ImagePromptConfig& config, models::TrainedImageTokenizer& tokenizer);
models::ImagePrompt encode_image_prompt(const PromptImage& prompt, models::TrainedImageTokenizer& tokenizer);

}  // namespace dalle::generate
