#include "dalle/train/trainers/superres_trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/image.h"
#include "dalle/data/image_grid.h"
#include "dalle/data/loader.h"
#include "dalle/device.h"
#include "dalle/io/checkpoint.h"
#include "dalle/log.h"
#include "dalle/models/dvae_objective.h"
#include "dalle/train/adamw.h"
#include "dalle/train/ema.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/update_step.h"
#include "train/run_directory.h"
#include "train/trainers/trainer_support.h"

namespace dalle::train {
namespace fs = std::filesystem;

void SuperResTrainConfig::visit(ConfigVisitor& v) {
  v.field("kind", kind, "the network trained: rrdbnet (Real-ESRGAN's generator)", {.choices = {"rrdbnet"}});
  v.section("model", "RRDBNet sizes (basicsr's argument names; Real-ESRGAN: 64 features, 23 blocks, growth 32)",
            model);
  v.section("data", "datasets and batching; image_size is the high-resolution crop side", data);
  v.section("degradation",
            "how a low-resolution input is made from each high-resolution image (Real-ESRGAN's first-order "
            "degradation: blur, downscale by model.scale, noise, JPEG)",
            degradation);
  v.section("learning_rate", "cosine learning-rate schedule (Real-ESRNet: 2e-4)", learning_rate);
  visit_shared_sections(v, {optimizer, run, precision, distributed});
  v.field("validation_images", validation_images, "held-out images each validation scores (PSNR against bicubic)",
          {.min = 1, .max = 100000});
  v.field("grid_images", grid_images, "validation images in each sample grid", {.min = 1, .max = 256});
}

void SuperResTrainConfig::validate() const {
  if (data.train.empty() || data.validation.empty()) {
    throw Error("super-resolution training: data.train and data.validation must name dataset folders");
  }
  model.validate();
  degradation.validate();
  if (model.num_in_ch != 3 || model.num_out_ch != 3) {
    throw Error("super-resolution training: the degradation makes RGB pairs, so model.num_in_ch and "
                "model.num_out_ch must be 3");
  }
  const int64_t multiple = model.scale * model.unshuffle_factor();
  if (data.image_size % multiple != 0) {
    throw Error("super-resolution training: data.image_size (" + std::to_string(data.image_size) +
                ") must be a multiple of " + std::to_string(multiple) + " (model.scale " + std::to_string(model.scale) +
                " times the pixel-unshuffle factor " + std::to_string(model.unshuffle_factor()) + ")");
  }
  if (std::min(learning_rate.start, learning_rate.end) < 0.0) {
    throw Error("super-resolution training: learning_rate.start and learning_rate.end cannot be negative");
  }
}

struct SuperResTrainer::State : detail::ImageTrainerState<SuperResTrainConfig, models::RrdbNet> {
  State(SuperResTrainConfig c, fs::path r) : ImageTrainerState("super-resolution", std::move(c), std::move(r)) {}

  SuperResStepMetrics train_step(const torch::Tensor& images);  // high-resolution, on the CPU
  void log_step(const SuperResStepMetrics& metrics);
  bool may_change_on_resume(const std::string& key) const override {
    return ImageTrainerState::may_change_on_resume(key) || key == "validation_images";
  }
};

namespace {

// A generator for one degradation: std::seed_seq is specified exactly, so the same
// (seed, step, index) gives the same low-res image with every standard library.
std::mt19937_64 degradation_rng(int64_t seed, int64_t step, int64_t index, uint32_t salt) {
  const auto word = [](int64_t value, int shift) { return static_cast<uint32_t>(static_cast<uint64_t>(value) >> shift); };
  std::seed_seq sequence{salt, word(seed, 0), word(seed, 32), word(step, 0), word(step, 32), word(index, 0)};
  return std::mt19937_64(sequence);
}

constexpr uint32_t kTrainSalt = 0x5271, kValidationSalt = 0x7a11;

void write_grid(const torch::Tensor& low, const torch::Tensor& ours, const torch::Tensor& original, int64_t count,
                int64_t step, const fs::path& run) {
  std::vector<torch::Tensor> tiles;
  std::vector<std::string> labels;
  const int64_t side = original.size(2);
  const auto nearest =
      torch::nn::functional::InterpolateFuncOptions().size(std::vector<int64_t>{side, side}).mode(torch::kNearest);
  for (int64_t i = 0; i < std::min<int64_t>(count, original.size(0)); ++i) {
    tiles.push_back(torch::nn::functional::interpolate(low[i].unsqueeze(0), nearest).squeeze(0));
    tiles.push_back(ours[i]);
    tiles.push_back(original[i]);
    labels.insert(labels.end(), {"low-res (nearest)", "ours, update " + std::to_string(step), "original"});
  }
  char name[48];
  std::snprintf(name, sizeof name, "samples/step-%09lld.png", static_cast<long long>(step));
  data::write_png((run / name).string(),
                  data::make_grid(tiles, labels, {.columns = 3, .tile_size = std::max<int64_t>(side, 128)}));
}

}  // namespace

torch::Tensor SuperResTrainer::degrade_batch(const torch::Tensor& high, const SuperResTrainConfig& config,
                                             int64_t step, BatchShare share) {
  std::vector<torch::Tensor> low;
  for (int64_t i = 0; i < high.size(0); ++i) {
    auto rng = degradation_rng(config.run.seed, step, i * share.ranks + share.rank, kTrainSalt);
    low.push_back(data::degrade(high[i], config.model.scale, config.degradation, rng));
  }
  return torch::stack(low);
}

SuperResTrainer::SuperResTrainer(SuperResTrainConfig config, std::string run_directory) {
  config.validate();
  state_ = detail::start_trainer<State>(std::move(config), run_directory, "super-resolution");
  auto& s = *state_;
  s.model = models::RrdbNet(s.config.model);
  s.place_model();
  s.build_update(s.model->parameters(), s.config.learning_rate.at(0));
  s.open_images();
  s.open_run(/*samples=*/true);
}

SuperResTrainer::~SuperResTrainer() = default;

int64_t SuperResTrainer::step() const { return state_->step; }
models::RrdbNet& SuperResTrainer::model() { return state_->model; }

SuperResStepMetrics SuperResTrainer::State::train_step(const torch::Tensor& images) {
  SuperResStepMetrics metrics;
  metrics.learning_rate = config.learning_rate.at(step);
  set_learning_rate(metrics.learning_rate);
  // Degraded on the CPU: the degradation draws from std:: generators, the same everywhere.
  const auto low = degrade_batch(images, config, step, {job->rank(), job->size()}).to(device);
  const auto high = images.to(device);
  auto output = [&] {
    AutocastGuard autocast(low.device().type(), precision->autocast_dtype());
    return model->forward(low);
  }();
  const auto loss = (output.to(torch::kFloat32) - high).abs().mean();
  metrics.skipped = apply_update(loss).skipped;
  ++step;
  metrics.step = step;
  metrics.loss = loss.item<double>();
  return metrics;
}

void SuperResTrainer::State::log_step(const SuperResStepMetrics& m) {
  append_metrics({{"step", m.step}, {"loss", m.loss}, {"learning_rate", m.learning_rate}});
}

void SuperResTrainer::run() {
  auto& s = *state_;
  detail::run_image_training_loop<SuperResStepMetrics>(s, [&](const SuperResStepMetrics& metrics) {
    const auto validation = validate();
    log::info("super-resolution: update ", s.step, " loss ", metrics.loss, " validation PSNR ", validation.psnr,
              " dB (bicubic ", validation.bicubic_psnr, " dB)");
  });
}

SuperResValidation SuperResTrainer::validate() {
  auto& s = *state_;
  s.ema->copy_to(*s.ema_model);
  s.ema_model->eval();
  torch::NoGradGuard no_grad;
  const int64_t count = std::min<int64_t>(static_cast<int64_t>(s.images.validation->size()), s.config.validation_images);
  const int64_t scale = s.config.model.scale;
  std::vector<torch::Tensor> lows, outputs, originals;
  double psnr_sum = 0, bicubic_sum = 0;
  int64_t scored = 0;
  for (int64_t begin = 0; begin < count; begin += s.config.data.batch_size) {
    std::vector<torch::Tensor> high, low;
    for (int64_t i = begin; i < std::min(count, begin + s.config.data.batch_size); ++i) {
      std::mt19937_64 caption_rng(static_cast<uint64_t>(i));
      auto example = s.images.validation->get(static_cast<size_t>(i), caption_rng);
      if (!example) continue;
      // The same degradation of image i at every validation, whatever the seed.
      auto rng = degradation_rng(0, 0, i, kValidationSalt);
      low.push_back(data::degrade(example->image, scale, s.config.degradation, rng));
      high.push_back(example->image);
    }
    if (high.empty()) continue;
    const auto original = torch::stack(high), input = torch::stack(low);
    const auto output = s.ema_model->forward(input.to(s.device)).clamp(0.0, 1.0).cpu();
    const auto n = static_cast<double>(original.size(0));
    psnr_sum += models::psnr(output, original) * n;
    bicubic_sum += models::psnr(data::bicubic_upscale(input, scale), original) * n;
    scored += original.size(0);
    if (static_cast<int64_t>(originals.size()) * s.config.data.batch_size < s.config.grid_images) {
      lows.push_back(input);
      outputs.push_back(output);
      originals.push_back(original);
    }
  }
  if (scored == 0) throw Error("super-resolution: no readable validation image in " + s.images.validation->root());
  SuperResValidation result{psnr_sum / scored, bicubic_sum / scored, scored};
  if (s.writes_files) {
    write_grid(torch::cat(lows), torch::cat(outputs), torch::cat(originals), s.config.grid_images, s.step, s.run);
  }
  s.metrics_log.append({{"step", s.step},
                        {"validation_psnr", result.psnr},
                        {"bicubic_psnr", result.bicubic_psnr},
                        {"psnr_gain", result.psnr - result.bicubic_psnr},
                        {"validation_images", result.images}});
  return result;
}

}  // namespace dalle::train
