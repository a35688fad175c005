#include "tool_support.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <charconv>
#include <csignal>
#include <iostream>
#include <thread>

#include "dalle/distributed/local_ranks.h"
#include "dalle/generate/pipeline.h"
#include "dalle/input_limits.h"
#include "dalle/io/checkpoint.h"
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

// "rank 1: " in a job of several processes, so that their errors can be told apart.
std::string error_prefix;

}  // namespace

void run_stoppable(const std::function<bool()>& train) {
  train::clear_stop_request();
  bool finished = false;
  {
    train::StopOnSignals stop_on_signals;
    finished = train();
  }
  // A signal after the last update stops nothing; a rank that stopped because another was
  // asked to exits as if it had been asked itself.
  if (!finished) throw ExitStatus{128 + (train::stop_requested() ? train::stop_signal() : SIGTERM)};
}

namespace {

// Shorthand option -> the pipeline config key it sets.
const std::map<std::string, std::string>& pipeline_shorthands() {
  static const std::map<std::string, std::string> shorthands = {
      {"--prior", "prior"},         {"--tokenizer", "tokenizer"}, {"--decoder", "decoder"},
      {"--clip", "clip"},           {"--superres", "superres"},   {"--candidates", "candidates"},
      {"--temperature", "sampling.temperature"},
      {"--top-k", "sampling.top_k"}, {"--top-p", "sampling.top_p"},
      {"--guidance-scale", "sampling.guidance_scale"}, {"--seed", "sampling.seed"},
      {"--device", "device"},       {"--threads", "threads"},     {"--dtype", "dtype"},
      {"--image-prompt", "image_prompt.image"}, {"--image-prompt-rows", "image_prompt.top_rows"},
      {"--image-prompt-mask", "image_prompt.mask"}};
  return shorthands;
}

}  // namespace

void PipelineShorthands::add_to(CLI::App& app, const std::set<std::string>& except, Adapters adapters) {
  for (const auto& [flag, key] : pipeline_shorthands()) {
    if (except.count(flag) > 0) continue;
    const bool filter = flag == "--top-k" || flag == "--top-p";
    app.add_option(flag, values_[flag], "sets `" + key + "`" + (filter ? " and clears the config's `schedule`" : ""));
  }
  counts_images_ = except.count("-n") == 0;
  if (counts_images_) {
    app.add_option("-n,--images", images_,
                   "images written per prompt, the best by CLIP score (dalle-serve's n): sets `keep`, and "
                   "`candidates` to at least n (to n without CLIP)");
    // The spellings of before -n meant what dalle-serve means by n: kept, with a warning.
    app.add_option("--keep", old_keep_, "")->group("");
    app.add_option("--images-per-prompt", old_candidates_, "")->group("");
  }
  app.add_flag("--no-cache", no_cache_,
               "recompute the whole prefix for each token (slow; a check); sets sampling.use_cache");
  adapter_kind_ = adapters;
  const auto help = adapters == Adapters::folded
                        ? "FILE or FILE:WEIGHT, repeatable: low-rank adapters (dalle-export --adapter) folded into the "
                          "prior's weights, in order; sets `adapters`"
                        : "NAME=FILE, repeatable: a low-rank adapter (dalle-export --adapter) that requests may choose "
                          "by NAME, with a weight (their `adapters`); sets `named_adapters`";
  app.add_option("--adapter", adapters_, help)->allow_extra_args(false)->take_all();
}

namespace {

// `key`=`value` set in `source` under `prefix`; a value the key refuses is a usage error of `flag`.
void set_shorthand(ConfigSource& source, const std::string& prefix, const std::string& flag, const std::string& key,
                   const std::string& value) {
  const std::string assignment = key + "=" + value;
  // A shorthand's value is part of the command line: checked alone, its error is a usage error.
  try {
    auto alone = ConfigSource::empty();
    alone.set(assignment);
    load_config<generate::PipelineConfig>(alone);
  } catch (const ConfigError& error) {
    throw UsageError(flag + " " + excerpt(value) + ": " + error.what());
  }
  source.set(prefix + assignment);
}

}  // namespace

void PipelineShorthands::apply(const CLI::App& app, ConfigSource& source, const std::string& prefix) const {
  for (const auto& [flag, value] : values_) {
    if (app.count(flag) > 0) set_shorthand(source, prefix, flag, pipeline_shorthands().at(flag), value);
  }
  if (counts_images_) apply_images(app, source, prefix);
  // A filter asked for on the command line replaces a model folder's schedule of filters.
  if (app.count("--top-k") + app.count("--top-p") > 0) {
    source.set(prefix + "schedule.top_k=[]");
    source.set(prefix + "schedule.top_p=[]");
  }
  if (no_cache_) source.set(prefix + "sampling.use_cache=false");
  if (!adapters_.empty()) {
    std::string list;
    for (const auto& adapter : adapters_) {
      std::string quoted;
      for (const char c : adapter) quoted += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
      list += (list.empty() ? "\"" : ", \"") + quoted + "\"";
    }
    const auto key = adapter_kind_ == Adapters::folded ? "adapters" : "named_adapters";
    source.set(prefix + key + "=[" + list + "]");
  }
}

namespace {

// -n's value: a whole number of images, at least one.
int64_t images_written(const std::string& text) {
  int64_t images = 0;
  const auto end = text.data() + text.size();
  const auto [ptr, error] = std::from_chars(text.data(), end, images);
  if (error != std::errc() || ptr != end || images < 1 || images > 65536) {
    throw UsageError("-n " + excerpt(text) + ": expected the images written per prompt, 1 to 65536");
  }
  return images;
}

}  // namespace

void PipelineShorthands::apply_images(const CLI::App& app, ConfigSource& source, const std::string& prefix) const {
  const bool by_candidates = app.count("--candidates") > 0, by_old_candidates = app.count("--images-per-prompt") > 0;
  if (by_old_candidates) {
    if (by_candidates) throw UsageError("--images-per-prompt is --candidates: give one");
    log::warn("--images-per-prompt is now --candidates (the samples drawn per prompt); -n is the images written");
    set_shorthand(source, prefix, "--images-per-prompt", "candidates", std::to_string(old_candidates_));
  }
  const bool by_n = app.count("-n") > 0, by_keep = app.count("--keep") > 0;
  if (!by_n && !by_keep) return;
  if (by_n && by_keep) throw UsageError("-n is the images written per prompt, as --keep was: give -n alone");
  if (by_keep) log::warn("--keep is now -n (the images written per prompt, as dalle-serve's n)");
  const int64_t images = by_n ? images_written(images_) : old_keep_;
  const auto config = load_config<generate::PipelineConfig>(source);
  if (config.clip.empty()) {
    // Nothing ranks the candidates: each one drawn is written.
    if ((by_candidates || by_old_candidates) && config.candidates != images) {
      throw UsageError("-n " + std::to_string(images) + " of " + std::to_string(config.candidates) +
                       " candidates needs a CLIP model (--clip) to choose them; without one every candidate is written");
    }
    set_shorthand(source, prefix, "-n", "candidates", std::to_string(images));
    return;
  }
  if ((by_candidates || by_old_candidates) && config.candidates < images) {
    throw UsageError("-n " + std::to_string(images) + " exceeds --candidates " + std::to_string(config.candidates) +
                     ": n of the candidates are written");
  }
  set_shorthand(source, prefix, "-n", "candidates", std::to_string(std::max(config.candidates, images)));
  set_shorthand(source, prefix, "-n", "keep", std::to_string(images));
}

void start_run_log(const std::string& run, const distributed::LaunchEnvironment& place) {
  if (place.world_size == 1) {
    log::add_file_sink(run + ".log");
    return;
  }
  const auto tag = "rank " + std::to_string(place.rank);
  error_prefix = tag + ": ";
  log::set_tag(tag);
  // A peer that vanished must fail a collective with an error, not end this rank silently.
  std::signal(SIGPIPE, SIG_IGN);
  if (place.rank == 0) {
    log::add_file_sink(run + ".log");
  } else {
    log::add_file_sink(run + ".rank" + std::to_string(place.rank) + ".log");
    log::set_console_level(log::Level::warn);
  }
}

void launch_local_ranks(const std::vector<std::string>& arguments, int64_t ranks, const std::string& run) {
  const auto cores = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  const auto outcome = distributed::run_local_ranks(
      {.ranks = ranks, .arguments = arguments, .threads_per_rank = std::max<int64_t>(1, cores / ranks)});
  if (outcome.failed_rank < 0) {
    if (outcome.exit_status != 0) throw ExitStatus{outcome.exit_status};
    return;
  }
  const auto latest = io::CheckpointStore(run + "/" + io::kCheckpointsFolder).latest();
  throw Error("the job has ended: rank " + std::to_string(outcome.failed_rank) + " " + outcome.failure +
              " and the other ranks were stopped; " +
              (latest ? "the last complete checkpoint is " + *latest + ": rerun the same command to resume from it"
                      : std::string("no checkpoint was written yet")) +
              " (each rank's log: " + run + ".log, " + run + ".rank<N>.log)");
}

int training_main(int argc, char** argv, const TrainingTool& tool, const TrainRecipe& train) {
  CLI::App app{tool.description + "; rerun the same command to resume."};
  app.name(tool.name);
  add_common_options(app);
  std::string run_directory;
  ConfigOptions config_options;
  app.add_option("--out", run_directory,
                 "run directory (config.yaml, metrics.jsonl, checkpoints/, sample grids); created, or resumed");
  config_options.add_to(app, "training run (" + tool.recipes + ")");
  int64_t nproc_per_node = 0;
  app.add_option("--nproc-per-node", nproc_per_node,
                 "train with N processes on this machine, as torchrun would start them "
                 "(the same as --set distributed.nproc_per_node=N; docs/distributed.md)")
      ->check(CLI::Range(1, 1024));
  return run_tool(app, argc, argv, [&] {
    auto source = config_options.source();
    if (nproc_per_node > 0) source.set_all({"distributed.nproc_per_node=" + std::to_string(nproc_per_node)});
    train({config_options, std::move(source), run_directory, std::vector<std::string>(argv, argv + argc)});
  });
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
  } catch (const ExitStatus& status) {
    return status.code;
  } catch (const UsageError& error) {
    std::cerr << app.get_name() << ": error: " << error.what() << "\nRun with --help for more information.\n";
    return kExitUsage;
  } catch (const c10::Error& error) {
    // torch's own message, without the C++ backtrace that means nothing to a user.
    std::cerr << app.get_name() << ": error: " << error_prefix << error.what_without_backtrace() << "\n";
    return kExitFailure;
  } catch (const std::exception& error) {
    std::cerr << app.get_name() << ": error: " << error_prefix << error.what() << "\n";
    return kExitFailure;
  }
}

}  // namespace dalle::tools
