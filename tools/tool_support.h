#pragma once
// What every dalle-* tool shares: --version, --log-level, --config/--set handling, and one
// place that turns errors into a message and a non-zero exit status.
#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

#include "dalle/config.h"

namespace dalle::tools {

// Exit statuses: 0 success, 1 the work failed (bad input, I/O), 2 bad command line; a
// training tool that SIGINT or SIGTERM stopped exits with 128 + the signal's number (130,
// 143), as a shell reports a process the signal ended.
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// A bad command line found after parsing (a missing option, no prompts, a bad value for a
// config shorthand): run_tool prints it and exits with kExitUsage.
class UsageError : public Error {
 public:
  using Error::Error;
};

// Adds --log-level and --version to `app`.
void add_common_options(CLI::App& app);

// --config FILE, repeated --set key.path=value, --print-config and --print-reference on a
// (sub)command.
struct ConfigOptions {
  std::string path;
  std::vector<std::string> overrides;
  bool print = false;
  bool print_reference = false;
  void add_to(CLI::App& command, const std::string& what);
  // The file (or the defaults when none was given) with the overrides applied.
  ConfigSource source() const;
  // Handles --print-config / --print-reference: prints and returns true when either was given.
  bool print_requested(const ConfigVisit& visit) const;
};

// Copies the log into `run`.log from now on.
void start_run_log(const std::string& run);

// Runs `train` (a trainer's run(), then whether it did all its updates) with SIGINT and
// SIGTERM turned into a stop request (dalle/train/stop_request.h): the trainer checkpoints
// and returns, and run_tool then exits with 128 + the signal's number, so that scripts and
// schedulers see the run did not finish. A second signal ends the process at once.
void run_stoppable(const std::function<bool()>& train);

// Parses the command line and runs `body`, printing any error as "dalle-x: error: ...".
int run_tool(CLI::App& app, int argc, char** argv, const std::function<void()>& body);

// What a training tool says of itself in --help.
struct TrainingTool {
  std::string name;         // "dalle-train"
  std::string description;  // what it trains
  std::string recipes;      // where its recipes are, "configs/prior/*.yaml"
};

// Trains what a recipe describes: the options, the recipe with its overrides, and --out.
using TrainRecipe = std::function<void(const ConfigOptions&, const ConfigSource&, const std::string& run)>;

// The main of every training tool: --out and the config options, the run's log file beside
// it, and `train` stoppable by SIGINT or SIGTERM; rerunning the same command resumes.
int training_main(int argc, char** argv, const TrainingTool& tool, const TrainRecipe& train);

// The TrainRecipe of one trainer: Config bound strictly from the recipe, --print-config and
// --print-reference answered, else Trainer run into `run` until its last update or a stop.
template <class Config, class Trainer>
void train_recipe(const ConfigOptions& options, const ConfigSource& source, const std::string& run) {
  auto config = load_config<Config>(source);
  if (options.print_requested(visit_of(config))) return;
  if (run.empty()) throw UsageError("--out is required");
  start_run_log(run);
  Trainer trainer(config, run);
  run_stoppable([&] {
    trainer.run();
    return trainer.step() >= config.run.steps;
  });
}

}  // namespace dalle::tools
