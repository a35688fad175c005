#include "dalle/train/trainers/dvae_trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/image.h"
#include "dalle/data/loader.h"
#include "dalle/device.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/log.h"
#include "dalle/models/dvae_objective.h"
#include "dalle/train/adamw.h"
#include "dalle/train/ema.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/update_step.h"
#include "dalle/train/optimizer_state.h"
#include "train/run_directory.h"
#include "train/trainers/trainer_support.h"

namespace dalle::train {
namespace fs = std::filesystem;

void DvaeTrainConfig::visit(ConfigVisitor& v) {
  v.field("kind", kind, "image tokenizer the recipe trains; dalle-train-vae reads it first (dvae: this table)",
          {.choices = {"dvae"}});
  v.section("model", "dVAE sizes", model);
  v.section("data", "datasets and batching", data);
  v.section("learning_rate", "cosine learning-rate schedule (DALL-E: 1e-4 -> 1.25e-6 over 1.2M updates)",
            learning_rate);
  v.section("temperature", "cosine gumbel-softmax temperature schedule (DALL-E: 1 -> 1/16 over 150k updates)",
            temperature);
  v.section("kl_weight", "cosine KL weight schedule, beta (DALL-E: 0 -> 6.6 over 5k updates)", kl_weight);
  v.field("straight_through", straight_through,
          "decode the one-hot argmax of the gumbel-softmax sample and pass the gradient through its soft "
          "relaxation, so that training decodes the one-hot codes tokenizing decodes (DALL-E: false, it anneals "
          "the temperature long enough for the soft codes to become nearly one-hot)");
  visit_shared_sections(v, {optimizer, run, precision, distributed});
  v.field("grid_images", grid_images, "validation images in each reconstruction grid", {.min = 1, .max = 256});
  v.field("reconstruction_loss", reconstruction_loss,
          "logit_laplace: DALL-E's likelihood, which also learns a per-pixel scale; mse: squared error of the "
          "decoded pixels (in the mapped range [eps, 1 - eps]), which cannot trade colour accuracy for a wider scale "
          "(pair it with a smaller kl_weight)",
          {.choices = {"logit_laplace", "mse"}});
}

struct DvaeTrainer::State : detail::ImageTrainerState<DvaeTrainConfig, models::Dvae> {
  at::Generator noise;  // gumbel noise, from the device's own kind of generator

  State(DvaeTrainConfig c, fs::path r)
      : ImageTrainerState("dvae", std::move(c), std::move(r)),
        noise(seeded_generator(device, static_cast<uint64_t>(config.run.seed))) {}

  DvaeStepMetrics train_step(const torch::Tensor& images);
  void log_step(const DvaeStepMetrics& metrics);
  void save_extra(io::Checkpoint& checkpoint) const override { checkpoint.state.emplace("rng.noise", noise.get_state()); }
  void restore_extra(const io::Checkpoint& checkpoint, const std::string&) override {
    restore_generator(noise, checkpoint.state.at("rng.noise"), "dvae");
  }
};

namespace {

// Values the schedules may not take: a zero temperature divides by zero, negative rates
// and weights train backwards.
void validate_schedules(const DvaeTrainConfig& config) {
  if (std::min(config.temperature.start, config.temperature.end) <= 0.0) {
    throw Error("dvae training: temperature.start and temperature.end must be positive");
  }
  if (std::min(config.learning_rate.start, config.learning_rate.end) < 0.0) {
    throw Error("dvae training: learning_rate.start and learning_rate.end cannot be negative");
  }
  if (std::min(config.kl_weight.start, config.kl_weight.end) < 0.0) {
    throw Error("dvae training: kl_weight.start and kl_weight.end cannot be negative");
  }
}

}  // namespace

DvaeTrainer::DvaeTrainer(DvaeTrainConfig config, std::string run_directory) {
  if (config.data.train.empty() || config.data.validation.empty()) {
    throw Error("dvae training: data.train and data.validation must name dataset folders");
  }
  config.model.validate();
  validate_schedules(config);
  if (config.data.image_size % config.model.downsampling_factor() != 0) {
    throw Error("dvae training: data.image_size must be a multiple of 2^model.downsamplings");
  }
  state_ = detail::start_trainer<State>(std::move(config), run_directory, "dVAE");
  auto& s = *state_;
  s.model = models::Dvae(s.config.model);
  s.place_model();
  s.build_update(s.model->parameters(), s.config.learning_rate.at(0));
  s.open_images();
  s.open_run(/*samples=*/true);
}

DvaeTrainer::~DvaeTrainer() = default;

int64_t DvaeTrainer::step() const { return state_->step; }
models::Dvae& DvaeTrainer::model() { return state_->model; }

DvaeStepMetrics DvaeTrainer::State::train_step(const torch::Tensor& images) {
  DvaeStepMetrics metrics;
  metrics.temperature = config.temperature.at(step);
  metrics.kl_weight = config.kl_weight.at(step);
  metrics.learning_rate = config.learning_rate.at(step);
  set_learning_rate(metrics.learning_rate);

  const auto pixels = models::map_pixels(images.to(device));
  torch::Tensor logits, output;
  {
    AutocastGuard autocast(pixels.device().type(), precision->autocast_dtype());
    logits = model->encoder->forward(pixels).to(torch::kFloat32);
    const auto codes = models::gumbel_softmax(logits, metrics.temperature, noise, config.straight_through);
    output = model->decoder->forward(codes).to(torch::kFloat32);
  }
  const auto reconstruction = config.reconstruction_loss == "mse"
                                  ? models::mapped_pixel_mse(output, pixels)
                                  : models::logit_laplace_nll(output, pixels);
  const auto kl = models::kl_to_uniform(logits);
  // DALL-E divides the whole loss by the number of pixel values; the KL, a mean per token
  // position, is therefore scaled by positions / pixel values = 1 / (f^2 C).
  const double f = static_cast<double>(config.model.downsampling_factor());
  const auto loss = reconstruction + metrics.kl_weight * kl / (f * f * static_cast<double>(config.model.input_channels));

  metrics.skipped = apply_update(loss, [&] {
                      return "reconstruction " + std::to_string(reconstruction.item<double>()) + ", KL " +
                             std::to_string(kl.item<double>());
                    }).skipped;
  ++step;

  metrics.step = step;
  metrics.loss = loss.item<double>();
  metrics.reconstruction = reconstruction.item<double>();
  metrics.kl = kl.item<double>();
  return metrics;
}

void DvaeTrainer::run() {
  auto& s = *state_;
  detail::run_image_training_loop<DvaeStepMetrics>(s, [&](const DvaeStepMetrics& metrics) {
    detail::log_tokenizer_validation("dvae", s.step, metrics.loss, validate());
  });
}

void DvaeTrainer::State::log_step(const DvaeStepMetrics& m) {
  append_metrics({{"step", m.step}, {"loss", m.loss}, {"reconstruction", m.reconstruction}, {"kl", m.kl},
                  {"temperature", m.temperature}, {"kl_weight", m.kl_weight}, {"learning_rate", m.learning_rate}});
}

DvaeValidation DvaeTrainer::validate() {
  auto& s = *state_;
  s.ema->copy_to(*s.ema_model);
  s.ema_model->eval();
  return detail::validate_tokenizer(*s.ema_model, *s.images.validation, s.config.data.batch_size, s.config.grid_images,
                                    s);
}

}  // namespace dalle::train
