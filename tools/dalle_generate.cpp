// dalle-generate: captions in, images out, through dalle::generate::Pipeline: N samples
// per prompt from the prior, decoded, optionally reranked by CLIP to the best K and
// upscaled; one PNG and JSON sidecar per kept image and a grid.
#include <filesystem>
#include <fstream>
#include <map>

#include "dalle/generate/pipeline.h"
#include "dalle/log.h"
#include "tool_support.h"

using namespace dalle;

namespace {

std::vector<std::string> read_prompts(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot read the prompts file");
  std::vector<std::string> prompts;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) prompts.push_back(line);
  }
  return prompts;
}

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
  app.add_option("--out", out, "output folder: one PNG and JSON per image, grid.png");
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
      if (app.count(flag) > 0) source.set(key + "=" + shorthand_values[flag]);
    }
    if (no_cache) source.set("sampling.use_cache=false");
    auto config = load_config<generate::PipelineConfig>(source);
    if (config_options.print_requested(visit_of(config))) return;
    if (out.empty()) throw Error("--out is required: the folder the images are written to");
    if (!prompts_file.empty()) {
      for (auto& prompt : read_prompts(prompts_file)) prompts.push_back(std::move(prompt));
    }
    if (prompts.empty()) throw Error("no captions: give them as arguments or with --prompts-file");
    generate::Pipeline pipeline(config);
    const auto images = pipeline.generate(prompts);
    generate::write_generation(out, pipeline.config(), images);
    log::info("generate: ", images.size(), " images and grid.png in ", out);
  });
}
