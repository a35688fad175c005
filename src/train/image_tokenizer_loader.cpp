#include "dalle/train/image_tokenizer_loader.h"

#include "dalle/config.h"
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

}  // namespace dalle::train
