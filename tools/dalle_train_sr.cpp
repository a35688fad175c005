// dalle-train-sr: trains a super-resolution RRDBNet (Real-ESRNet's L1 stage) from a YAML
// recipe on an image dataset, degrading each image on the fly; rerunning the same command
// resumes from the run directory's last checkpoint.
#include "dalle/train/trainers/superres_trainer.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  return tools::training_main(argc, argv,
                              {"dalle-train-sr",
                               "Trains Real-ESRGAN's generator (RRDBNet) on degraded copies of an image dataset with "
                               "an L1 loss",
                               "configs/superres/*.yaml"},
                              tools::train_recipe<train::SuperResTrainConfig, train::SuperResTrainer>);
}
