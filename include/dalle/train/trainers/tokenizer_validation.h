#pragma once
// What the image-tokenizer trainers (dVAE, VQGAN) report on held-out images.
#include <torch/types.h>

#include "dalle/models/image_tokenizer.h"

namespace dalle::train {

struct TokenizerValidation {
  double psnr = 0;        // dB, of decode(encode(image)) with the EMA weights
  double perplexity = 0;  // exp(entropy) of the codes those images use
  double codes_used = 0;  // fraction of the codebook
  double decoder_sensitivity = 0;  // see decoder_sensitivity()
};

// Mean absolute pixel change (images in [0, 1]) when each of `tokens`' [B, h, w] grids is
// decoded in place of the next one's. 0 means the decoder ignores its codes: the collapse
// of a saturated decoder (docs/dvae.md), which PSNR alone does not tell from slow learning.
double decoder_sensitivity(models::ImageTokenizer& tokenizer, const torch::Tensor& tokens);

}  // namespace dalle::train
