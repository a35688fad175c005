// dalle-train-sr: trains a super-resolution RRDBNet (Real-ESRNet's L1 stage) from a YAML
// recipe on an image dataset, degrading each image on the fly; rerunning the same command
// resumes from the run directory's last checkpoint.
#include "dalle/log.h"
#include "dalle/train/superres_trainer.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  CLI::App app{"Trains Real-ESRGAN's generator (RRDBNet) on degraded copies of an image dataset with an L1 loss; "
               "rerun the same command to resume."};
  app.name("dalle-train-sr");
  tools::add_common_options(app);
  std::string run_directory;
  tools::ConfigOptions config_options;
  app.add_option("--out", run_directory, "run directory: config, metrics.jsonl, samples/, checkpoints/");
  config_options.add_to(app, "training run (configs/superres/*.yaml)");

  return tools::run_tool(app, argc, argv, [&] {
    auto config = load_config<train::SuperResTrainConfig>(config_options.source());
    if (config_options.print_requested(visit_of(config))) return;
    if (run_directory.empty()) throw tools::UsageError("--out is required");
    log::add_file_sink(run_directory + ".log");
    train::SuperResTrainer trainer(config, run_directory);
    tools::run_stoppable([&] {
      trainer.run();
      return trainer.step() >= config.steps;
    });
  });
}
