// dalle-generate: captions in, images out, through dalle::generate::Pipeline: N samples
// per prompt from the prior, decoded, optionally reranked by CLIP to the best K and
// upscaled; one PNG and JSON sidecar per kept image and a grid.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>

#include "dalle/generate/pipeline.h"
#include "dalle/input_limits.h"
#include "dalle/io/atomic_file.h"
#include "dalle/io/stale_temporaries.h"
#include "dalle/log.h"
#include "tool_support.h"

using namespace dalle;
namespace fs = std::filesystem;

namespace {

// One line of at most `limit` bytes (the rest of a longer line is skipped, counted in
// `length`); false at the end of the file.
bool read_bounded_line(std::istream& in, size_t limit, std::string& line, size_t& length) {
  line.clear();
  length = 0;
  int c;
  while ((c = in.get()) != EOF && c != '\n') {
    if (length++ < limit) line += static_cast<char>(c);
  }
  return c != EOF || length > 0;
}

// Blank lines are skipped; a prompt that is too long or not UTF-8 is refused by its line.
std::vector<std::string> read_prompts(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw tools::UsageError(path + ": cannot read the prompts file");
  const auto limit = static_cast<size_t>(max_text_bytes());
  std::vector<std::string> prompts;
  std::string line;
  size_t length = 0;
  for (int64_t number = 1; read_bounded_line(in, limit + 1, line, length); ++number) {
    const bool whole = length == line.size();
    if (whole && !line.empty() && line.back() == '\r') {
      line.pop_back();
      --length;
    }
    if (whole && line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(number);
    check_prompt(line, where, length);
    prompts.push_back(line);
  }
  return prompts;
}

// What dalle-generate writes into its folder, and dalle-eval's report of it.
bool written_by_generate(const fs::path& entry) {
  static const std::regex own(R"(\d{4,}-\d{2,}\.(png|json)|grid\.png|eval\.json)");
  return std::regex_match(entry.filename().string(), own);
}

// The output folder, written whole: the images go to a staging folder beside it, which
// replaces it once all are written. So an earlier output is never mixed with this one's
// (no stale sidecars), and a failed run leaves the folder as it was. Only a new or empty
// folder, or an earlier dalle-generate output, may be replaced.
class OutputFolder {
 public:
  explicit OutputFolder(const std::string& target) : target_(without_trailing_slash(target)) {
    if (fs::exists(target_)) {
      if (!fs::is_directory(target_)) throw Error(target_ + ": exists and is not a folder");
      for (const auto& entry : fs::directory_iterator(target_)) {
        if (!written_by_generate(entry.path())) {
          throw Error(target_ + ": not empty and not an earlier dalle-generate output (it holds " +
                      excerpt(entry.path().filename().string()) + "); choose another folder");
        }
      }
      if (::access(target_.c_str(), W_OK) != 0) {
        throw Error(target_ + ": cannot be replaced: " + std::strerror(errno));
      }
    }
    io::remove_stale_temporaries(target_);
    // Created now, so that a folder that cannot be written is refused before any work.
    staging_ = io::temporary_sibling(target_);
    try {
      const auto parent = fs::path(staging_).parent_path();
      if (!parent.empty()) fs::create_directories(parent);
      fs::create_directory(staging_);
    } catch (const fs::filesystem_error& error) {
      throw Error(target_ + ": cannot write the output folder: " + error.code().message());
    }
  }
  ~OutputFolder() {
    std::error_code ignored;
    if (!committed_) fs::remove_all(staging_, ignored);
  }
  OutputFolder(const OutputFolder&) = delete;
  OutputFolder& operator=(const OutputFolder&) = delete;

  const std::string& staging() const { return staging_; }

  void commit() {
    std::optional<std::string> previous;
    if (fs::exists(target_)) {
      previous = io::temporary_sibling(target_);
      fs::rename(target_, *previous);
    }
    try {
      fs::rename(staging_, target_);
    } catch (...) {
      if (previous) fs::rename(*previous, target_);
      throw;
    }
    committed_ = true;
    if (previous) fs::remove_all(*previous);
  }

 private:
  // "out/" and "out" are one folder, and its temporaries are siblings, never inside it.
  static std::string without_trailing_slash(const std::string& path) {
    auto normal = fs::path(path).lexically_normal();
    return (normal.has_filename() ? normal : normal.parent_path()).string();
  }

  std::string target_, staging_;
  bool committed_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Draws images for captions: samples from a trained prior, decodes, and optionally reranks with "
               "CLIP and upscales. Options below are shorthands for pipeline config keys (docs/config.md)."};
  app.name("dalle-generate");
  tools::add_common_options(app);
  tools::ConfigOptions config_options;
  config_options.add_to(app, "pipeline");
  std::vector<std::string> prompts;
  std::string prompts_file, out;
  app.add_option("prompts", prompts, "captions to draw");
  app.add_option("--prompts-file", prompts_file, "a file of captions, one per line");
  app.add_option("--out", out,
                 "output folder: one PNG and JSON per image, grid.png (new, empty, or an earlier output, "
                 "which is replaced whole)");
  // Shorthand option -> the config key it sets.
  const std::map<std::string, std::string> shorthands = {
      {"--prior", "prior"},         {"--tokenizer", "tokenizer"}, {"--decoder", "decoder"},
      {"--clip", "clip"},           {"--superres", "superres"},   {"--images-per-prompt", "candidates"},
      {"--keep", "keep"},           {"--temperature", "sampling.temperature"},
      {"--top-k", "sampling.top_k"}, {"--top-p", "sampling.top_p"},
      {"--guidance-scale", "sampling.guidance_scale"}, {"--seed", "sampling.seed"},
      {"--device", "device"},       {"--threads", "threads"}};
  std::map<std::string, std::string> shorthand_values;
  for (const auto& [flag, key] : shorthands) {
    const std::string names = flag == "--images-per-prompt" ? "-n,--images-per-prompt" : flag;
    app.add_option(names, shorthand_values[flag], "sets `" + key + "`");
  }
  bool no_cache = false;
  app.add_flag("--no-cache", no_cache, "recompute the whole prefix for each token (slow; a check); sets sampling.use_cache");

  return tools::run_tool(app, argc, argv, [&] {
    auto source = config_options.source();
    for (const auto& [flag, key] : shorthands) {
      if (app.count(flag) == 0) continue;
      const std::string assignment = key + "=" + shorthand_values[flag];
      // A shorthand's value is part of the command line: checked alone, its error is a usage error.
      try {
        auto alone = ConfigSource::empty();
        alone.set(assignment);
        load_config<generate::PipelineConfig>(alone);
      } catch (const ConfigError& error) {
        throw tools::UsageError(flag + " " + excerpt(shorthand_values[flag]) + ": " + error.what());
      }
      source.set(assignment);
    }
    if (no_cache) source.set("sampling.use_cache=false");
    auto config = load_config<generate::PipelineConfig>(source);
    if (config_options.print_requested(visit_of(config))) return;
    if (out.empty()) throw tools::UsageError("--out is required: the folder the images are written to");
    for (size_t i = 0; i < prompts.size(); ++i) {
      try {
        check_prompt(prompts[i], "prompt " + std::to_string(i + 1));
      } catch (const Error& error) {
        throw tools::UsageError(error.what());
      }
    }
    if (!prompts_file.empty()) {
      for (auto& prompt : read_prompts(prompts_file)) prompts.push_back(std::move(prompt));
    }
    if (prompts.empty()) throw tools::UsageError("no captions: give them as arguments or with --prompts-file");
    OutputFolder output(out);
    generate::Pipeline pipeline(config);
    const auto images = pipeline.generate(prompts);
    generate::write_generation(output.staging(), pipeline.config(), images);
    output.commit();
    log::info("generate: ", images.size(), " images and grid.png in ", out);
  });
}
