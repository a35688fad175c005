// dalle-train: trains a prior on a token dataset from a YAML recipe, resuming from the run
// directory's last checkpoint when there is one. The recipe's top-level `kind` (prior when
// absent) picks the prior: the sparse transformer, or DALL-E Mega / Mini's BART prior
// (bart_prior), which fine-tunes from an imported checkpoint.
#include "dalle/train/trainers/bart_prior_trainer.h"
#include "dalle/train/trainers/prior_trainer.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  return tools::training_main(
      argc, argv,
      {"dalle-train", "Trains a prior on a token dataset (kind: prior or bart_prior)",
       "configs/prior/*.yaml"},
      [](const tools::TrainRequest& request) {
        if (peek_choice(request.source, "kind", "prior", {"prior", "bart_prior"}) == "bart_prior") {
          tools::train_recipe<train::BartPriorTrainConfig, train::BartPriorTrainer>(request);
        } else {
          tools::train_recipe<train::PriorTrainConfig, train::PriorTrainer>(request);
        }
      });
}
