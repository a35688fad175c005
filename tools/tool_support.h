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

// Runs `train` (a trainer's run(), then whether it did all its updates) with SIGINT and
// SIGTERM turned into a stop request (dalle/train/stop_request.h): the trainer checkpoints
// and returns, and run_tool then exits with 128 + the signal's number, so that scripts and
// schedulers see the run did not finish. A second signal ends the process at once.
void run_stoppable(const std::function<bool()>& train);

// Parses the command line and runs `body`, printing any error as "dalle-x: error: ...".
int run_tool(CLI::App& app, int argc, char** argv, const std::function<void()>& body);

}  // namespace dalle::tools
