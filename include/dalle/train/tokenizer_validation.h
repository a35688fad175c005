#pragma once
// What the image-tokenizer trainers (dVAE, VQGAN) report on held-out images.

namespace dalle::train {

struct TokenizerValidation {
  double psnr = 0;        // dB, of decode(encode(image)) with the EMA weights
  double perplexity = 0;  // exp(entropy) of the codes those images use
  double codes_used = 0;  // fraction of the codebook
};

}  // namespace dalle::train
