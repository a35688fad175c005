#include "train/trainers/trainer_support.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "dalle/data/image.h"
#include "dalle/data/image_grid.h"
#include "dalle/log.h"
#include "dalle/models/dvae_objective.h"

namespace dalle::train::detail {
namespace fs = std::filesystem;

ImageData open_image_data(const data::ImageDataConfig& config, int64_t rank_batch, data::SamplerOptions shard) {
  ImageData images;
  images.train = data::ImageCaptionDataset::open(
      config.train, {.image_size = config.image_size, .random_crop = config.random_crop});
  images.validation = data::ImageCaptionDataset::open(config.validation, {.image_size = config.image_size});
  images.loader = std::make_unique<data::DataLoader<data::ImageCaptionDataset>>(
      images.train, data::LoaderOptions{.batch_size = rank_batch, .workers = config.workers, .sampler = shard});
  return images;
}

torch::Tensor stack_images(const std::vector<data::ImageCaptionExample>& examples) {
  std::vector<torch::Tensor> images;
  for (const auto& example : examples) images.push_back(example.image);
  return torch::stack(images);
}

data::Batch<data::ImageCaptionExample> next_nonempty_batch(ImageData& images) {
  // A whole epoch without one readable image means none will come: say so, do not spin.
  for (int64_t empty = 0; empty < images.loader->batches_per_epoch(); ++empty) {
    auto batch = images.loader->next();
    if (!batch.examples.empty()) return batch;
  }
  throw Error(images.train->root() + ": a whole epoch without a readable image (" +
              images.train->report().summary() + ")");
}

torch::Tensor next_image_batch(ImageData& images) { return stack_images(next_nonempty_batch(images).examples); }

namespace {

void write_grid(const torch::Tensor& original, const torch::Tensor& reconstruction, int64_t count, int64_t step,
                const fs::path& run) {
  std::vector<torch::Tensor> tiles;
  std::vector<std::string> labels;
  for (int64_t i = 0; i < std::min<int64_t>(count, original.size(0)); ++i) {
    tiles.push_back(original[i]);
    tiles.push_back(reconstruction[i]);
    labels.push_back("original");
    labels.push_back("update " + std::to_string(step));
  }
  char name[48];
  std::snprintf(name, sizeof name, "samples/step-%09lld.png", static_cast<long long>(step));
  data::write_png((run / name).string(), data::make_grid(tiles, labels, {.columns = 4, .tile_size = 128}));
}

}  // namespace

TokenizerValidation validate_tokenizer(models::ImageTokenizer& tokenizer, const data::ImageCaptionDataset& images,
                                       int64_t batch_size, int64_t grid_images, const RunRecord& record) {
  const auto& what = record.what;
  const int64_t step = record.step;
  torch::NoGradGuard no_grad;
  const auto device = tokenizer.module().parameters().front().device();
  const int64_t count = std::min<int64_t>(static_cast<int64_t>(images.size()), 256);
  std::vector<torch::Tensor> originals, reconstructions, tokens;
  for (int64_t begin = 0; begin < count; begin += batch_size) {
    std::vector<data::ImageCaptionExample> examples;
    for (int64_t i = begin; i < std::min(count, begin + batch_size); ++i) {
      std::mt19937_64 rng(static_cast<uint64_t>(i));
      if (auto example = images.get(static_cast<size_t>(i), rng)) examples.push_back(std::move(*example));
    }
    if (examples.empty()) continue;
    const auto batch = stack_images(examples);
    const auto codes = tokenizer.encode_tokens(batch.to(device));
    originals.push_back(batch);
    tokens.push_back(codes);
    reconstructions.push_back(tokenizer.decode_tokens(codes).cpu());
  }
  if (originals.empty()) throw Error(what + ": no readable validation image in " + images.root());
  const auto original = torch::cat(originals), reconstruction = torch::cat(reconstructions);
  const auto all_tokens = torch::cat(tokens);
  const auto usage = models::codebook_usage(all_tokens, tokenizer.vocab_size());
  TokenizerValidation result{models::psnr(reconstruction, original), usage.perplexity, usage.used_fraction,
                             all_tokens.size(0) < 2 ? std::nan("")
                                                    : decoder_sensitivity(tokenizer, all_tokens.slice(
                                                                                         0, 0, std::max<int64_t>(batch_size, 2)))};
  if (record.writes_files) write_grid(original, reconstruction, grid_images, step, record.run);
  record.metrics_log.append({{"step", step}, {"validation_psnr", result.psnr}, {"perplexity", result.perplexity},
                  {"codes_used", result.codes_used}, {"decoder_sensitivity", result.decoder_sensitivity}});
  return result;
}

void log_tokenizer_validation(const std::string& what, int64_t step, double loss,
                              const TokenizerValidation& validation) {
  log::info(what, ": update ", step, " loss ", loss, " validation PSNR ", validation.psnr, " dB, perplexity ",
            validation.perplexity, ", codes used ", validation.codes_used, ", decoder sensitivity ",
            validation.decoder_sensitivity);
}

}  // namespace dalle::train::detail

namespace dalle::train {

double decoder_sensitivity(models::ImageTokenizer& tokenizer, const torch::Tensor& tokens) {
  if (tokens.size(0) < 2) throw Error("decoder_sensitivity needs at least two token grids");
  torch::NoGradGuard no_grad;
  const auto own = tokenizer.decode_tokens(tokens), others = tokenizer.decode_tokens(tokens.roll(1, 0));
  return (own - others).abs().mean().item<double>();
}

}  // namespace dalle::train
