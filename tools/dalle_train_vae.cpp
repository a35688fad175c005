// dalle-train-vae: trains an image tokenizer (OpenAI's dVAE or a VQGAN) from a YAML recipe,
// resuming from the run directory's last checkpoint when there is one. The recipe's
// top-level `kind` (dvae when absent) picks which set of keys the rest is read against.
#include <iostream>

#include "dalle/log.h"
#include "dalle/train/dvae_trainer.h"
#include "dalle/train/vqgan_trainer.h"
#include "tool_support.h"

using namespace dalle;

namespace {

template <class Config, class Trainer>
void train_kind(const tools::ConfigOptions& options, const ConfigSource& source, const std::string& run_directory) {
  auto config = load_config<Config>(source);
  if (options.print_requested(visit_of(config))) return;
  if (run_directory.empty()) throw tools::UsageError("--out is required");
  log::add_file_sink(run_directory + ".log");
  Trainer trainer(config, run_directory);
  tools::run_stoppable([&] {
    trainer.run();
    return trainer.step() >= config.steps;
  });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Trains the image tokenizer (kind: dvae or vqgan); rerun the same command to resume."};
  app.name("dalle-train-vae");
  tools::add_common_options(app);
  std::string run_directory;
  tools::ConfigOptions config_options;
  app.add_option("--out", run_directory, "run directory: config, metrics.jsonl, samples/, checkpoints/");
  config_options.add_to(app, "training run (configs/dvae/*.yaml, configs/vqgan/*.yaml)");

  return tools::run_tool(app, argc, argv, [&] {
    const auto source = config_options.source();
    if (peek_choice(source, "kind", "dvae", {"dvae", "vqgan"}) == "vqgan") {
      train_kind<train::VqganTrainConfig, train::VqganTrainer>(config_options, source, run_directory);
    } else {
      train_kind<train::DvaeTrainConfig, train::DvaeTrainer>(config_options, source, run_directory);
    }
  });
}
