// dalle-generate: captions in, images out, through dalle::generate::Pipeline: N samples
// per prompt from the prior, decoded, optionally reranked by CLIP to the best K and
// upscaled; one PNG and JSON sidecar per kept image and a grid.
#include <algorithm>
#include <filesystem>

#include "dalle/data/image.h"
#include "dalle/data/image_grid.h"
#include "dalle/generate/output.h"
#include "dalle/generate/pipeline.h"
#include "dalle/input_limits.h"
#include "dalle/log.h"
#include "tool_support.h"

using namespace dalle;

namespace {

// Where the previews of the candidates being drawn go: beside the output folder, since the
// folder itself is replaced whole at the end.
std::filesystem::path preview_path(const std::string& out) {
  auto folder = std::filesystem::path(out).lexically_normal();
  if (folder.filename().empty()) folder = folder.parent_path();
  return folder.string() + ".preview.png";
}

// Writes the batch's previews as one grid at the images' own size, a row per prompt's
// candidates; not the last (the images themselves follow). Unlabelled: text and upscaling
// made each grid cost more than the decode it shows.
generate::PreviewCallback preview_writer(const std::filesystem::path& path, int64_t columns) {
  return [=](const std::vector<generate::Preview>& previews) {
    if (previews.empty() || previews.front().drawn == previews.front().total) return;
    std::vector<torch::Tensor> tiles;
    for (const auto& preview : previews) tiles.push_back(preview.image);
    data::write_png(path.string(), data::make_grid(tiles, {}, {.columns = columns}));
  };
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
  std::string prompts_file, out, model_folder;
  app.add_option("--model", model_folder,
                 "a model folder: its generate.yaml and the models beside it (models/fashion-compose), in place of "
                 "--config; the options below override it")
      ->check(CLI::ExistingDirectory);
  app.add_option("prompts", prompts, "captions to draw");
  app.add_option("--prompts-file", prompts_file, "a file of captions, one per line")->check(CLI::ExistingFile);
  app.add_option("--out", out,
                 "output folder: one PNG and JSON per image, grid.png (new, empty, or an earlier output, "
                 "which is replaced whole)");
  int64_t preview_every = 0;
  app.add_option("--preview-every", preview_every,
                 "every N image tokens, write the candidates being drawn (rows not drawn yet blank) to "
                 "<out>.preview.png beside the output folder, removed once the images are written (0: none)")
      ->check(CLI::NonNegativeNumber);
  int64_t preview_candidates = 1;
  app.add_option("--preview-candidates", preview_candidates,
                 "how many of each prompt's candidates the previews show, the first ones (0: all; each one shown "
                 "is decoded once more per preview)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  tools::PipelineShorthands shorthands;
  shorthands.add_to(app);

  return tools::run_tool(app, argc, argv, [&] {
    auto source = config_options.source();
    if (!model_folder.empty()) {
      if (!config_options.path.empty()) throw tools::UsageError("--model and --config both give the pipeline; give one");
      auto folder = generate::read_model_folder(model_folder);
      source = ConfigSource::from_string(config_to_yaml(visit_of(folder)), model_folder + "/" +
                                                                               generate::kModelFolderConfig);
      source.set_all(config_options.overrides);
    }
    shorthands.apply(app, source);
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
      for (auto& prompt : generate::read_prompts_file(prompts_file)) prompts.push_back(std::move(prompt));
    }
    if (prompts.empty()) throw tools::UsageError("no captions: give them as arguments or with --prompts-file");
    generate::OutputFolder output(out);
    generate::Pipeline pipeline(config);
    std::vector<generate::PreparedRequest> requests;
    for (size_t index = 0; index < prompts.size(); ++index) {
      requests.push_back(pipeline.prepare(prompts[index], static_cast<int64_t>(index),
                                          [&](generate::PromptRequest& request) {
                                            request.preview_every = preview_every;
                                            request.preview_candidates = preview_candidates;
                                          }));
    }
    const auto preview = preview_path(out);
    const auto columns = preview_candidates == 0 ? config.candidates : std::min(preview_candidates, config.candidates);
    const auto images = pipeline.generate(
        requests, preview_every > 0 ? preview_writer(preview, columns) : generate::PreviewCallback());
    generate::write_generation(output.staging(), pipeline.config(), images);
    output.commit();
    if (preview_every > 0) std::filesystem::remove(preview);
    log::info("generate: ", images.size(), " images and grid.png in ", out);
  });
}
