// dalle-train-clip: trains CLIP on an image-caption dataset from a YAML recipe, resuming
// from the run directory's last checkpoint when there is one.
#include "dalle/train/trainers/clip_trainer.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  return tools::training_main(
      argc, argv,
      {"dalle-train-clip", "Trains CLIP (contrastive image-caption model) for reranking", "configs/clip/*.yaml"},
      tools::train_recipe<train::ClipTrainConfig, train::ClipTrainer>);
}
