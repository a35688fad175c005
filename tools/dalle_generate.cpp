// dalle-generate: captions in, images out. Samples image tokens from a trained prior
// (KV-cached, batched), decodes them with the image tokenizer, and writes one PNG per
// image, a grid, and a JSON sidecar per image with every setting that made it.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dalle/data/image.h"
#include "dalle/io/atomic_file.h"
#include "dalle/log.h"
#include "dalle/models/prior_sampling.h"
#include "dalle/text/tokenizer.h"
#include "dalle/train/image_tokenizer_loader.h"
#include "dalle/train/prior_trainer.h"
#include "tool_support.h"

using namespace dalle;
namespace fs = std::filesystem;

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
  CLI::App app{"Draws images for captions with a trained prior and image tokenizer."};
  app.name("dalle-generate");
  tools::add_common_options(app);
  std::string prior_path, tokenizer_path, decoder_path, prompts_file, out;
  std::vector<std::string> prompts;
  int64_t images_per_prompt = 4;
  models::SamplingOptions sampling;
  app.add_option("prompts", prompts, "captions to draw");
  app.add_option("--prompts-file", prompts_file, "a file of captions, one per line");
  app.add_option("--prior", prior_path, "prior run directory or checkpoint")->required();
  app.add_option("--tokenizer", tokenizer_path, "caption tokenizer model (default: the prior run's)");
  app.add_option("--decoder", decoder_path, "dVAE or VQGAN run or checkpoint (default: the prior run's image tokenizer)");
  app.add_option("--out", out, "output folder: one PNG and JSON per image, grid.png")->required();
  app.add_option("-n,--images-per-prompt", images_per_prompt, "images per caption, sampled as one batch")
      ->check(CLI::Range(1, 4096));
  app.add_option("--temperature", sampling.temperature, "divides the logits")->check(CLI::Range(1e-4, 100.0));
  app.add_option("--top-k", sampling.top_k, "sample among the k likeliest codes (0: all)")->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", sampling.top_p, "nucleus sampling mass (1: all)")->check(CLI::Range(1e-6, 1.0));
  app.add_option("--guidance-scale", sampling.guidance_scale, "classifier-free guidance scale (1: none)")
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--seed", sampling.seed, "seed of the first caption; caption i uses seed + i")
      ->check(CLI::NonNegativeNumber);
  bool no_cache = false;
  app.add_flag("--no-cache", no_cache, "recompute the whole prefix for each token (slow; a check)");

  return tools::run_tool(app, argc, argv, [&] {
    sampling.use_cache = !no_cache;
    if (!prompts_file.empty()) {
      for (auto& prompt : read_prompts(prompts_file)) prompts.push_back(std::move(prompt));
    }
    if (prompts.empty()) throw Error("no captions: give them as arguments or with --prompts-file");
    auto prior = train::load_trained_prior(prior_path);
    if (tokenizer_path.empty()) tokenizer_path = prior.config.tokenizer;
    if (decoder_path.empty()) decoder_path = prior.config.image_tokenizer;
    if (tokenizer_path.empty() || decoder_path.empty()) {
      throw Error("the prior run names no tokenizer or image tokenizer: give --tokenizer and --decoder");
    }
    const auto tokenizer = text::Tokenizer::load(tokenizer_path);
    auto decoder = train::load_image_tokenizer(decoder_path);
    fs::create_directories(out);

    std::vector<torch::Tensor> tiles;
    std::vector<std::string> labels;
    log::Progress progress("generate", static_cast<int64_t>(prompts.size()) * prior.config.model.image_length());
    for (size_t index = 0; index < prompts.size(); ++index) {
      const auto encoding = tokenizer.encode(prompts[index]);
      if (encoding.truncated) log::warn("caption ", index, " is longer than the prior's text and was cut");
      auto options = sampling;
      options.seed = sampling.seed + static_cast<int64_t>(index);
      const auto captions = torch::tensor(encoding.ids, torch::kInt64).repeat({images_per_prompt, 1});
      const auto tokens = models::sample_image_tokens(prior.model, captions, options, nullptr,
                                                      [&](int64_t, int64_t) { progress.advance(); });
      torch::NoGradGuard no_grad;
      const auto images = decoder.model->decode_tokens(tokens);
      for (int64_t i = 0; i < images_per_prompt; ++i) {
        char stem[64];
        std::snprintf(stem, sizeof stem, "%04zu-%02lld", index, static_cast<long long>(i));
        data::write_png((fs::path(out) / (std::string(stem) + ".png")).string(), images[i]);
        const auto codes = tokens[i].flatten().contiguous();
        const nlohmann::json sidecar = {
            {"prompt", prompts[index]},       {"seed", options.seed},
            {"batch_row", i},                 {"images_in_batch", images_per_prompt},
            {"temperature", options.temperature}, {"top_k", options.top_k},
            {"top_p", options.top_p},         {"guidance_scale", options.guidance_scale},
            {"use_cache", options.use_cache}, {"prior", prior.checkpoint},
            {"tokenizer", tokenizer_path},    {"decoder", decoder_path},
            {"image_tokens", std::vector<int64_t>(codes.data_ptr<int64_t>(), codes.data_ptr<int64_t>() + codes.numel())}};
        io::write_file_atomic((fs::path(out) / (std::string(stem) + ".json")).string(), sidecar.dump(2) + "\n");
        tiles.push_back(images[i]);
        labels.push_back(prompts[index]);
      }
    }
    progress.finish();
    data::write_png((fs::path(out) / "grid.png").string(),
                    data::make_grid(tiles, labels, {.columns = images_per_prompt, .tile_size = 128}));
    log::info("generate: ", tiles.size(), " images and grid.png in ", out);
  });
}
