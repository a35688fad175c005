#pragma once
// Turns an image-caption dataset into the token dataset stage 2 trains on: each image
// through a trained image tokenizer (a dVAE's argmax tokens or a VQGAN's codes), each
// caption through the text tokenizer.
#include <cstdint>
#include <string>

#include "dalle/data/token_dataset.h"

namespace dalle::generate {

struct EncodeImagesOptions {
  std::string dataset;    // image-caption dataset folder
  std::string image_tokenizer;  // dVAE or VQGAN run directory or checkpoint
  std::string tokenizer;  // tokenizer model (its config beside it)
  std::string out;        // token dataset folder
  int64_t batch_size = 32;
  int64_t workers = 2;
  int64_t images_per_shard = 4096;
};

data::TokenDatasetInfo encode_images(const EncodeImagesOptions& options);

}  // namespace dalle::generate
