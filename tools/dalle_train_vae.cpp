// dalle-train-vae: trains an image tokenizer (OpenAI's dVAE or a VQGAN) from a YAML recipe,
// resuming from the run directory's last checkpoint when there is one. The recipe's
// top-level `kind` (dvae when absent) picks which set of keys the rest is read against.
#include "dalle/train/trainers/dvae_trainer.h"
#include "dalle/train/trainers/vqgan_trainer.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  return tools::training_main(
      argc, argv,
      {"dalle-train-vae", "Trains the image tokenizer (kind: dvae or vqgan)", "configs/dvae/*.yaml, configs/vqgan/*.yaml"},
      [](const tools::TrainRequest& request) {
        if (peek_choice(request.source, "kind", "dvae", {"dvae", "vqgan"}) == "vqgan") {
          tools::train_recipe<train::VqganTrainConfig, train::VqganTrainer>(request);
        } else {
          tools::train_recipe<train::DvaeTrainConfig, train::DvaeTrainer>(request);
        }
      });
}
