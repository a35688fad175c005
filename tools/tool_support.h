#pragma once
// What every dalle-* tool shares: --version, --log-level, --config/--set handling, and one
// place that turns errors into a message and a non-zero exit status.
#include <CLI/CLI.hpp>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/distributed/launch.h"
#include "dalle/log.h"

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

// The pipeline config's shorthand options (--prior, --clip, -n, --top-k, --threads, ...) of
// dalle-generate and dalle-serve: each sets one key of generate::PipelineConfig, but -n, the
// images written per prompt as dalle-serve's n counts them, which sets `keep` and as many
// `candidates` as it needs.
class PipelineShorthands {
 public:
  // What --adapter sets: `adapters`, folded at load (FILE or FILE:WEIGHT), or, for dalle-serve,
  // `named_adapters` that requests choose (NAME=FILE).
  enum class Adapters { folded, named };
  // Adds every shorthand but those named in `except` ("-n", "--candidates").
  void add_to(CLI::App& app, const std::set<std::string>& except = {}, Adapters adapters = Adapters::folded);
  // Sets the keys of the shorthands given on `app`'s command line in `source`, each under
  // `prefix` ("" for a pipeline config, "pipeline." within dalle-serve's). A value the key
  // refuses is a UsageError naming the option; --top-k or --top-p clears `schedule`.
  void apply(const CLI::App& app, ConfigSource& source, const std::string& prefix = "") const;

 private:
  // -n (or the --keep of before) on `source`: keep, and candidates to at least n; the
  // --images-per-prompt of before as --candidates.
  void apply_images(const CLI::App& app, ConfigSource& source, const std::string& prefix) const;

  std::map<std::string, std::string> values_;  // by option
  bool counts_images_ = false;  // -n and the old spellings were added (not in dalle-serve)
  std::string images_;  // -n, read when applied (its errors are usage errors naming -n)
  int64_t old_keep_ = 0, old_candidates_ = 0;
  std::vector<std::string> adapters_;
  Adapters adapter_kind_ = Adapters::folded;
  bool no_cache_ = false;
};

// Copies the log into `run`.log from now on; in a job of several processes, rank r > 0
// writes `run`.rank<r>.log and shows only warnings and errors on the terminal.
void start_run_log(const std::string& run, const distributed::LaunchEnvironment& place);

// --nproc-per-node without a launcher: runs `ranks` copies of this tool's command line
// (distributed/local_ranks.h) and ends as they do. When a rank fails, throws Error naming it, how it
// ended and the run's last complete checkpoint.
void launch_local_ranks(const std::vector<std::string>& arguments, int64_t ranks, const std::string& run);

// Ends the tool with `code`, its reason already reported (a stop signal, a launcher's ranks).
struct ExitStatus {
  int code;
};

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

// What a training tool was asked to do: the config options, the recipe with its overrides,
// --out, and the whole command line (which --nproc-per-node runs again for every rank).
struct TrainRequest {
  const ConfigOptions& options;
  ConfigSource source;
  std::string run;
  std::vector<std::string> arguments;
};
using TrainRecipe = std::function<void(const TrainRequest&)>;

// The main of every training tool: --out and the config options, the run's log file beside
// it, and `train` stoppable by SIGINT or SIGTERM; rerunning the same command resumes.
int training_main(int argc, char** argv, const TrainingTool& tool, const TrainRecipe& train);

// The TrainRecipe of one trainer: Config bound strictly from the recipe, --print-config and
// --print-reference answered, else Trainer run into `run` until its last update or a stop,
// by this process or, given distributed.nproc_per_node > 1 and no launcher, by that many.
template <class Config, class Trainer>
void train_recipe(const TrainRequest& request) {
  auto config = load_config<Config>(request.source);
  if (request.options.print_requested(visit_of(config))) return;
  if (request.run.empty()) throw UsageError("--out is required");
  const auto place = distributed::read_launch_environment();
  const int64_t nproc = config.distributed.nproc_per_node;
  if (place.launcher == "none" && nproc > 1) {
    launch_local_ranks(request.arguments, nproc, request.run);
    return;
  }
  if (nproc > 1 && nproc != place.local_world_size && place.rank == 0) {
    log::warn("distributed.nproc_per_node ", nproc, " is ignored: ", place.launcher, " started ",
              place.local_world_size, " ranks per machine");
  }
  start_run_log(request.run, place);
  Trainer trainer(config, request.run);
  run_stoppable([&] {
    trainer.run();
    return trainer.step() >= config.run.steps;
  });
}

}  // namespace dalle::tools
