#include "tool_support.h"

#include <c10/util/Exception.h>

#include <iostream>

#include "dalle/log.h"
#include "dalle/runtime.h"
#include "dalle/train/stop_request.h"

namespace dalle::tools {

void add_common_options(CLI::App& app) {
  app.set_version_flag("--version", [] { return runtime_summary(); });
  app.add_option_function<std::string>(
         "--log-level", [](const std::string& level) { log::set_level(log::level_from_string(level)); },
         "debug, info (default), warn, error or off")
      ->check(CLI::IsMember({"debug", "info", "warn", "error", "off"}));
  app.require_subcommand(0, 1);
}

void ConfigOptions::add_to(CLI::App& command, const std::string& what) {
  command.add_option("--config", path, "YAML config of the " + what + " (keys: docs/config.md)")
      ->check(CLI::ExistingFile);
  command.add_option("--set", overrides, "override a config key: --set key.path=value (repeatable)");
  command.add_flag("--print-config", print, "print the effective config as YAML and exit");
  command.add_flag("--print-reference", print_reference, "print every config key as a Markdown table and exit");
}

ConfigSource ConfigOptions::source() const {
  auto source = path.empty() ? ConfigSource::empty() : ConfigSource::from_file(path);
  source.set_all(overrides);
  return source;
}

bool ConfigOptions::print_requested(const ConfigVisit& visit) const {
  if (print) std::cout << config_to_yaml(visit);
  if (print_reference) std::cout << config_reference(visit);
  return print || print_reference;
}

namespace {

// Thrown by run_stoppable for run_tool, which turns it into the exit status.
struct StoppedBySignal {
  int signal;
};

}  // namespace

void run_stoppable(const std::function<bool()>& train) {
  train::clear_stop_request();
  bool finished = false;
  {
    train::StopOnSignals stop_on_signals;
    finished = train();
  }
  // A signal after the last update stops nothing.
  if (!finished && train::stop_requested()) throw StoppedBySignal{train::stop_signal()};
}

void start_run_log(const std::string& run) { log::add_file_sink(run + ".log"); }

int training_main(int argc, char** argv, const TrainingTool& tool, const TrainRecipe& train) {
  CLI::App app{tool.description + "; rerun the same command to resume."};
  app.name(tool.name);
  add_common_options(app);
  std::string run_directory;
  ConfigOptions config_options;
  app.add_option("--out", run_directory,
                 "run directory (config.yaml, metrics.jsonl, checkpoints/, sample grids); created, or resumed");
  config_options.add_to(app, "training run (" + tool.recipes + ")");
  return run_tool(app, argc, argv, [&] { train(config_options, config_options.source(), run_directory); });
}

int run_tool(CLI::App& app, int argc, char** argv, const std::function<void()>& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : kExitUsage;  // --help and --version exit 0
  }
  try {
    body();
    return 0;
  } catch (const StoppedBySignal& stopped) {
    return 128 + stopped.signal;
  } catch (const UsageError& error) {
    std::cerr << app.get_name() << ": error: " << error.what() << "\nRun with --help for more information.\n";
    return kExitUsage;
  } catch (const c10::Error& error) {
    // torch's own message, without the C++ backtrace that means nothing to a user.
    std::cerr << app.get_name() << ": error: " << error.what_without_backtrace() << "\n";
    return kExitFailure;
  } catch (const std::exception& error) {
    std::cerr << app.get_name() << ": error: " << error.what() << "\n";
    return kExitFailure;
  }
}

}  // namespace dalle::tools
