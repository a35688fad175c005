// dalle-train: trains the transformer prior on a token dataset from a YAML recipe,
// resuming from the run directory's last checkpoint when there is one.
#include "dalle/log.h"
#include "dalle/train/prior_trainer.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  CLI::App app{"Trains the transformer prior on a token dataset; rerun the same command to resume."};
  app.name("dalle-train");
  tools::add_common_options(app);
  std::string run_directory;
  tools::ConfigOptions config_options;
  app.add_option("--out", run_directory, "run directory: config, metrics.jsonl, samples/, checkpoints/");
  config_options.add_to(app, "training run (configs/prior/*.yaml)");

  return tools::run_tool(app, argc, argv, [&] {
    auto config = load_config<train::PriorTrainConfig>(config_options.source());
    if (config_options.print_requested(visit_of(config))) return;
    if (run_directory.empty()) throw tools::UsageError("--out is required");
    log::add_file_sink(run_directory + ".log");
    train::PriorTrainer trainer(config, run_directory);
    tools::run_stoppable([&] {
      trainer.run();
      return trainer.step() >= config.steps;
    });
  });
}
