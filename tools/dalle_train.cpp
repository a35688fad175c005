// dalle-train: trains the transformer prior on a token dataset from a YAML recipe,
// resuming from the run directory's last checkpoint when there is one.
#include "dalle/train/trainers/prior_trainer.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  return tools::training_main(
      argc, argv, {"dalle-train", "Trains the transformer prior on a token dataset", "configs/prior/*.yaml"},
      tools::train_recipe<train::PriorTrainConfig, train::PriorTrainer>);
}
