#include "dalle/train/dvae_trainer.h"

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
#include "dalle/train/optimizer_state.h"
#include "dalle/model_config.h"
#include "run_directory.h"
#include "trainer_support.h"

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
  v.field("beta1", beta1, "AdamW beta1", {.min = 0.0, .max = 1.0});
  v.field("beta2", beta2, "AdamW beta2", {.min = 0.0, .max = 1.0});
  v.field("epsilon", epsilon, "AdamW epsilon", {.min = 0.0});
  v.field("weight_decay", weight_decay, "AdamW decoupled weight decay (DALL-E: 1e-4)", {.min = 0.0});
  v.field("ema_decay", ema_decay, "decay of the weights' moving average (DALL-E: 0.999)", {.min = 0.0, .max = 0.999999});
  v.section("precision", "fp32, bf16, or fp16 with one dynamic gradient scale", precision);
  detail::visit_interval_keys(v, *this, "PSNR, codebook usage, grid");
  v.field("grid_images", grid_images, "validation images in each reconstruction grid", {.min = 1, .max = 256});
  v.field("reconstruction_loss", reconstruction_loss,
          "logit_laplace: DALL-E's likelihood, which also learns a per-pixel scale; mse: squared error of the "
          "decoded pixels (in the mapped range [eps, 1 - eps]), which cannot trade colour accuracy for a wider scale "
          "(pair it with a smaller kl_weight)",
          {.choices = {"logit_laplace", "mse"}});
  detail::visit_seed_and_device_keys(v, *this, "initialisation, data order and gumbel noise", "the dVAE trains");
}

struct DvaeTrainer::State : RunRecord {
  DvaeTrainConfig config;
  torch::Device device;
  models::Dvae model{nullptr};
  models::Dvae ema_model{nullptr};
  std::unique_ptr<Ema> ema;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<ModelPrecision> precision;
  detail::ImageData images;
  at::Generator noise;

  State(DvaeTrainConfig c, fs::path r)
      : RunRecord("dvae", std::move(r), c.keep_checkpoints),
        config(std::move(c)),
        device(resolve_device(config.device, "dvae training")),
        noise(seeded_generator(device, static_cast<uint64_t>(config.seed))) {}

  DvaeStepMetrics train_step(const torch::Tensor& images);
  void log_step(const DvaeStepMetrics& metrics);
  void save_checkpoint();
  void resume(const std::string& directory);
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
  check_run_directory(run_directory, "dVAE");
  if (config.data.image_size % config.model.downsampling_factor() != 0) {
    throw Error("dvae training: data.image_size must be a multiple of 2^model.downsamplings");
  }
  prepare_torch(config.threads, config.seed);

  state_ = std::make_unique<State>(std::move(config), fs::path(run_directory));
  auto& s = *state_;

  s.model = models::Dvae(s.config.model);
  s.model->to(s.device);
  s.ema_model = models::Dvae(s.config.model);
  s.ema_model->to(s.device);
  s.ema = std::make_unique<Ema>(*s.model, s.config.ema_decay);
  s.optimizer = detail::make_adamw(s.model->parameters(), s.config);
  s.precision = std::make_unique<ModelPrecision>(s.config.precision, s.model->parameters());

  s.images = detail::open_image_data(s.config.data, s.config.seed);
  s.open(visit_of(s.config), /*samples=*/true, [&s](const std::string& latest) { s.resume(latest); });
}

DvaeTrainer::~DvaeTrainer() = default;

int64_t DvaeTrainer::step() const { return state_->step; }
models::Dvae& DvaeTrainer::model() { return state_->model; }

DvaeStepMetrics DvaeTrainer::State::train_step(const torch::Tensor& images) {
  DvaeStepMetrics metrics;
  metrics.temperature = config.temperature.at(step);
  metrics.kl_weight = config.kl_weight.at(step);
  metrics.learning_rate = config.learning_rate.at(step);
  for (auto& group : optimizer->param_groups()) group.options().set_lr(metrics.learning_rate);

  const auto pixels = data::map_pixels(images.to(device));
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

  if (!torch::isfinite(loss).item<bool>()) {
    // Stop before the weights, the EMA or a checkpoint take the non-finite values.
    throw Error("dvae: the loss is not finite at update " + std::to_string(step + 1) +
                " (reconstruction " + std::to_string(reconstruction.item<double>()) + ", KL " +
                std::to_string(kl.item<double>()) + "); lower the learning rate or resume from an earlier checkpoint");
  }
  optimizer->zero_grad();
  precision->scaled(loss).backward();
  metrics.skipped = !precision->unscale_and_update();
  if (metrics.skipped) {
    log::warn("dvae: gradients not finite at update ", step + 1, "; the update is skipped");
  } else {
    optimizer->step();
    ema->update(*model);
  }
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
  nlohmann::json line = {{"step", m.step}, {"loss", m.loss}, {"reconstruction", m.reconstruction},
                         {"kl", m.kl}, {"temperature", m.temperature},
                         {"kl_weight", m.kl_weight}, {"learning_rate", m.learning_rate}};
  if (const auto* scaler = precision->scaler()) {
    line.update({{"grad_scale", scaler->scale(0)}, {"skipped_updates", scaler->skipped_updates()}});
  }
  metrics_log.append(line);
}

DvaeValidation DvaeTrainer::validate() {
  auto& s = *state_;
  s.ema->copy_to(*s.ema_model);
  s.ema_model->eval();
  return detail::validate_tokenizer(*s.ema_model, *s.images.validation, s.config.data.batch_size, s.config.grid_images,
                                    s.step, s.run, s.metrics_log, "dvae");
}

void DvaeTrainer::State::save_checkpoint() {
  auto checkpoint = make_checkpoint(config_to_yaml(visit_of(config)), *model, *ema, *optimizer, step, images.loader->position());
  checkpoint.state.emplace("rng.noise", noise.get_state());
  precision->save_state(checkpoint.state, "gradient_scaler.");
  save(checkpoint);
}

void DvaeTrainer::State::resume(const std::string& directory) {
  auto checkpoint = io::load_checkpoint(directory);
  check_resumable<DvaeTrainConfig>(config, checkpoint.config_yaml, directory + "/config.yaml",
                                   detail::may_change_on_resume);
  const auto progress = restore_checkpoint(checkpoint, directory, *model, *ema, *optimizer);
  restore_generator(noise, checkpoint.state.at("rng.noise"), "dvae");
  precision->load_state(checkpoint.state, "gradient_scaler.");
  images.loader->seek(progress.position);
  resumed(directory, progress.step);
}

TrainedDvae load_trained_dvae(const std::string& run_or_checkpoint) {
  const auto directory = resolve_checkpoint(run_or_checkpoint, "dVAE");
  const auto checkpoint = io::load_checkpoint(directory);
  const auto config = load_model_config<DvaeTrainConfig>(checkpoint.config_yaml, directory + "/config.yaml");
  const auto ema = detail::with_prefix_removed(checkpoint.state, "ema.");
  TrainedDvae trained{models::Dvae(config.model), config.data.image_size};
  io::load_state_dict(*trained.model, ema.empty() ? checkpoint.weights : ema, directory);
  trained.model->eval();
  return trained;
}

}  // namespace dalle::train
