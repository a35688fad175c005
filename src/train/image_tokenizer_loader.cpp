#include "dalle/train/image_tokenizer_loader.h"

#include <torch/torch.h>

#include "dalle/config.h"
#include "dalle/error.h"
#include "dalle/train/dvae_trainer.h"
#include "dalle/train/vqgan_trainer.h"
#include "run_directory.h"

namespace dalle::train {

TrainedImageTokenizer load_image_tokenizer(const std::string& run_or_checkpoint) {
  const std::string directory = resolve_checkpoint(run_or_checkpoint, "dVAE or VQGAN");
  // Only the kind is read here; the loader of that kind reads and checks the whole config.
  const auto kind = peek_choice(ConfigSource::from_file(directory + "/config.yaml"), "kind", "dvae", {"dvae", "vqgan"});
  if (kind == "vqgan") {
    auto trained = load_trained_vqgan(directory);
    return {kind, trained.model.ptr(), trained.image_size};
  }
  auto trained = load_trained_dvae(directory);
  return {kind, trained.model.ptr(), trained.image_size};
}

torch::Tensor round_trip(TrainedImageTokenizer& tokenizer, const torch::Tensor& images) {
  if (images.dim() != 4 || images.size(2) != tokenizer.image_size || images.size(3) != tokenizer.image_size) {
    throw Error("round trip through a " + tokenizer.kind + ": expected [B, C, " + std::to_string(tokenizer.image_size) +
                ", " + std::to_string(tokenizer.image_size) + "] images, got " + c10::str(images.sizes()));
  }
  torch::NoGradGuard no_grad;
  return tokenizer.model->decode_tokens(tokenizer.model->encode_tokens(images)).clamp(0, 1);
}

}  // namespace dalle::train
