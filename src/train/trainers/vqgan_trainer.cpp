#include "dalle/train/trainers/vqgan_trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "dalle/models/trained.h"
#include "dalle/data/caption_dataset.h"
#include "dalle/data/loader.h"
#include "dalle/device.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/log.h"
#include "dalle/models/patch_discriminator.h"
#include "dalle/train/adamw.h"
#include "dalle/train/ema.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/update_step.h"
#include "dalle/train/optimizer_state.h"
#include "train/run_directory.h"
#include "train/trainers/trainer_support.h"

namespace dalle::train {
namespace fs = std::filesystem;

void VqganTrainConfig::visit(ConfigVisitor& v) {
  v.field("kind", kind, "image tokenizer the recipe trains; dalle-train-vae reads it first (vqgan: this table)",
          {.choices = {"vqgan"}});
  v.section("model", "VQGAN sizes (taming-transformers' ddconfig, ruDALL-E's names)", model);
  v.field("init_from", init_from,
          "VQGAN run or checkpoint whose weights (its moving average) the run starts from, instead of a random "
          "initialisation; its model sizes must be these (empty: random)");
  v.field("trainable", trainable,
          "the weights that learn: all, or decoder (post_quant_conv and the decoder, on the argmax tokens of the "
          "frozen encoder and codebook, as at inference; needs init_from; no quantizer loss, no code restarts)",
          {.choices = {"all", "decoder"}});
  v.section("data", "datasets and batching", data);
  v.field("reconstruction_loss", reconstruction_loss,
          "pixel loss between images and reconstructions in model.pixel_range: l1 (taming) or mse", {.choices = {"l1", "mse"}});
  v.section("learning_rate", "cosine learning-rate schedule, shared by the discriminator", learning_rate);
  v.section("temperature",
            "cosine gumbel-softmax temperature schedule, gumbel quantizer only (ruDALL-E's recipe: 0.9 -> 1e-6 "
            "over 1M updates)",
            temperature);
  v.field("kl_weight", kl_weight, "weight of the gumbel quantizer's KL to the uniform prior (ruDALL-E: 1e-8)",
          {.min = 0.0});
  v.field("commitment", commitment,
          "beta: weight of the vector quantizer's commitment term; the codebook term has weight 1 (VQ-VAE: 0.25)",
          {.min = 0.0});
  v.field("restart_every", restart_every,
          "vector quantizer: every this many updates, codes no encoder output chose since the last restart are "
          "moved onto encoder outputs of the current batch (0: never)",
          {.min = 0});
  v.section("discriminator", "PatchGAN discriminator with hinge losses (taming's VQGAN loss without LPIPS)",
            discriminator);
  visit_shared_sections(v, {optimizer, run, precision, distributed});
  v.field("grid_images", grid_images, "validation images in each reconstruction grid", {.min = 1, .max = 256});
}

struct VqganTrainer::State : detail::ImageTrainerState<VqganTrainConfig, models::Vqgan> {
  models::PatchDiscriminator discriminator{nullptr};
  std::unique_ptr<AdamW> discriminator_optimizer;
  std::unique_ptr<ModelPrecision> discriminator_precision;
  std::unique_ptr<UpdateStep> discriminator_update;
  at::Generator noise;  // gumbel noise and code restarts, from the device's own kind of generator
  torch::Tensor usage;  // vector quantizer: how often each code was chosen since the last restart

  State(VqganTrainConfig c, fs::path r)
      : ImageTrainerState("vqgan", std::move(c), std::move(r)),
        noise(seeded_generator(device, static_cast<uint64_t>(config.run.seed))),
        usage(torch::zeros({config.model.n_embed}, torch::kInt64)) {}

  VqganStepMetrics train_step(const torch::Tensor& images);
  torch::Tensor reconstruction_loss(const torch::Tensor& output, const torch::Tensor& target) const;
  double adaptive_factor(const torch::Tensor& reconstruction, const torch::Tensor& adversarial);
  torch::Tensor discriminate(const torch::Tensor& images);  // patch logits, fp32
  double train_discriminator(const torch::Tensor& real, const torch::Tensor& fake);
  int64_t track_usage(const models::VqganOutput& out);
  bool decoder_only() const { return config.trainable == "decoder"; }
  void initialise_from(const std::string& run_or_checkpoint);
  // What the optimizer updates; with trainable: decoder the rest stops requiring gradients.
  std::vector<torch::Tensor> learned_parameters();
  // trainable: decoder's pass: the frozen encoder's argmax tokens, decoded with gradients.
  models::VqganOutput decode_frozen_tokens(const torch::Tensor& images);
  void build_discriminator();
  void log_step(const VqganStepMetrics& metrics);
  void save_extra(io::Checkpoint& checkpoint) const override;
  void restore_extra(const io::Checkpoint& checkpoint, const std::string& directory) override;
};

namespace {

void validate_settings(const VqganTrainConfig& config) {
  if (config.data.train.empty() || config.data.validation.empty()) {
    throw Error("vqgan training: data.train and data.validation must name dataset folders");
  }
  config.model.validate();
  if (config.data.image_size % config.model.downsampling_factor() != 0) {
    throw Error("vqgan training: data.image_size must be a multiple of 2^(levels - 1) = " +
                std::to_string(config.model.downsampling_factor()));
  }
  if (config.trainable == "decoder" && config.init_from.empty()) {
    throw Error("vqgan training: trainable: decoder fine-tunes the decoder of a trained VQGAN; set init_from to its "
                "run or checkpoint");
  }
  if (config.model.gumbel() && std::min(config.temperature.start, config.temperature.end) <= 0.0) {
    throw Error("vqgan training: temperature.start and temperature.end must be positive");
  }
  if (std::min(config.learning_rate.start, config.learning_rate.end) < 0.0) {
    throw Error("vqgan training: learning_rate.start and learning_rate.end cannot be negative");
  }
  const int64_t smallest = models::PatchDiscriminatorImpl::min_image_size(config.discriminator.layers);
  if (config.discriminator.enabled && config.data.image_size < smallest) {
    throw Error("vqgan training: a discriminator with " + std::to_string(config.discriminator.layers) +
                " layers needs images of at least " + std::to_string(smallest) + " pixels; lower discriminator.layers");
  }
}

}  // namespace

VqganTrainer::VqganTrainer(VqganTrainConfig config, std::string run_directory) {
  validate_settings(config);
  state_ = detail::start_trainer<State>(std::move(config), run_directory, "VQGAN");
  auto& s = *state_;
  s.model = models::Vqgan(s.config.model);
  // A resumed run has its own weights; init_from is read only to start one.
  if (!s.config.init_from.empty() && !s.checkpoints.latest()) s.initialise_from(s.config.init_from);
  s.place_model();
  s.build_update(s.learned_parameters(), s.config.learning_rate.at(0));
  if (s.config.discriminator.enabled) s.build_discriminator();
  s.open_images();
  s.open_run(/*samples=*/true);
}

void VqganTrainer::State::build_discriminator() {
  discriminator = models::PatchDiscriminator(config.model.out_channels, config.discriminator.channels,
                                             config.discriminator.layers);
  discriminator->to(device);
  discriminator_optimizer = make_adamw({torch::optim::OptimizerParamGroup(discriminator->parameters())},
                                       config.learning_rate.at(0));
  discriminator_precision =
      std::make_unique<ModelPrecision>(config.precision, discriminator->parameters(), replicas());
  discriminator_update = std::make_unique<UpdateStep>(
      *discriminator_optimizer, *discriminator_precision,
      UpdateOptions{.what = "vqgan discriminator", .grad_clip = config.optimizer.grad_clip});
  discriminator_update->set_reducer(job->reducer());
}

VqganTrainer::~VqganTrainer() = default;

int64_t VqganTrainer::step() const { return state_->step; }
models::Vqgan& VqganTrainer::model() { return state_->model; }

torch::Tensor VqganTrainer::State::reconstruction_loss(const torch::Tensor& output, const torch::Tensor& target) const {
  return config.reconstruction_loss == "mse" ? (output - target).pow(2).mean() : (output - target).abs().mean();
}

double VqganTrainer::State::adaptive_factor(const torch::Tensor& reconstruction, const torch::Tensor& adversarial) {
  // taming's balance: both losses pull on the decoder's last layer about equally hard. In
  // fp16 both gradients are of the scaled losses, lest they underflow; the scale cancels.
  const auto last = model->decoder->last_layer_weight();
  const auto grad_norm = [&](const torch::Tensor& loss) {
    return torch::autograd::grad({precision->scaled(loss)}, {last}, {}, /*retain_graph=*/true)[0].norm();
  };
  const auto factor = grad_norm(reconstruction) / (grad_norm(adversarial) + 1e-4 * precision->scale());
  return factor.clamp(0.0, 1e4).item<double>();
}

torch::Tensor VqganTrainer::State::discriminate(const torch::Tensor& images) {
  AutocastGuard autocast(images.device().type(), discriminator_precision->autocast_dtype());
  return discriminator->forward(images).to(torch::kFloat32);
}

double VqganTrainer::State::train_discriminator(const torch::Tensor& real, const torch::Tensor& fake) {
  const auto loss = models::discriminator_hinge_loss(discriminate(real), discriminate(fake));
  // Its zero_grad also drops what the generator's loss left on the discriminator.
  discriminator_update->apply(loss, step + 1);
  return loss.item<double>();
}

void VqganTrainer::State::initialise_from(const std::string& run_or_checkpoint) {
  const auto trained = models::load_trained_vqgan(run_or_checkpoint);
  io::load_state_dict(*model, io::state_dict(*trained.model), run_or_checkpoint + " (init_from)");
}

std::vector<torch::Tensor> VqganTrainer::State::learned_parameters() {
  if (!decoder_only()) return model->parameters();
  for (auto& parameter : model->parameters()) parameter.requires_grad_(false);
  std::vector<torch::Tensor> learned = model->post_quant_conv->parameters();
  for (const auto& parameter : model->decoder->parameters()) learned.push_back(parameter);
  for (auto& parameter : learned) parameter.requires_grad_(true);
  return learned;
}

models::VqganOutput VqganTrainer::State::decode_frozen_tokens(const torch::Tensor& images) {
  models::VqganOutput out;
  {
    torch::NoGradGuard no_grad;
    out.quantized.tokens = model->encode_tokens(images);
    out.quantized.codes = model->lookup(out.quantized.tokens);
  }
  AutocastGuard autocast(images.device().type(), precision->autocast_dtype());
  out.reconstruction = model->decode_codes(out.quantized.codes);
  return out;
}

int64_t VqganTrainer::State::track_usage(const models::VqganOutput& out) {
  if (!model->vector || decoder_only()) return 0;
  usage += torch::bincount(out.quantized.tokens.flatten().to(torch::kCPU), {}, config.model.n_embed);
  if (config.restart_every == 0 || step % config.restart_every != 0) return 0;
  const auto restarted = model->vector->restart_unused(usage, out.latents, noise);
  usage.zero_();
  // The average would drag a restarted code back towards where it was useless.
  const auto& codes = model->vector->embedding->weight;
  ema->overwrite_rows("quantize.embedding.weight", restarted, codes.index_select(0, restarted.to(codes.device())));
  return restarted.numel();
}

VqganStepMetrics VqganTrainer::State::train_step(const torch::Tensor& images) {
  VqganStepMetrics metrics;
  metrics.temperature = config.temperature.at(step);
  metrics.learning_rate = config.learning_rate.at(step);
  set_learning_rate(metrics.learning_rate);
  if (discriminator_optimizer) {
    for (auto& group : discriminator_optimizer->param_groups()) group.options().set_lr(metrics.learning_rate);
  }

  const auto x = model->to_model_range(images.to(device));
  auto out = [&] {
    if (decoder_only()) return decode_frozen_tokens(images.to(device));
    AutocastGuard autocast(x.device().type(), precision->autocast_dtype());
    return model->forward(x, metrics.temperature, noise);
  }();
  out.reconstruction = out.reconstruction.to(torch::kFloat32);
  const auto reconstruction = reconstruction_loss(out.reconstruction, x);
  const auto& q = out.quantized;
  const auto quantizer = decoder_only() ? torch::zeros({}, x.options())
                         : model->gumbel ? config.kl_weight * q.kl
                                         : q.codebook + config.commitment * q.commitment;
  auto loss = reconstruction + quantizer;
  const bool adversarial = discriminator && step >= config.discriminator.start;
  torch::Tensor generator_loss;
  if (adversarial) {
    generator_loss = models::generator_hinge_loss(discriminate(out.reconstruction));
    const double factor = config.discriminator.adaptive_weight ? adaptive_factor(reconstruction, generator_loss) : 1.0;
    metrics.adversarial_weight = config.discriminator.weight * factor;
    loss = loss + metrics.adversarial_weight * generator_loss;
  }
  metrics.skipped = apply_update(loss, [&] {
                      return "reconstruction " + std::to_string(reconstruction.item<double>()) + ", quantizer " +
                             std::to_string(quantizer.item<double>());
                    }).skipped;
  if (adversarial) metrics.discriminator = train_discriminator(x, out.reconstruction.detach());
  ++step;
  metrics.restarted = track_usage(out);

  metrics.step = step;
  metrics.loss = loss.item<double>();
  metrics.reconstruction = reconstruction.item<double>();
  metrics.quantizer = quantizer.item<double>();
  metrics.adversarial = adversarial ? generator_loss.item<double>() : 0.0;
  return metrics;
}

void VqganTrainer::State::log_step(const VqganStepMetrics& m) {
  nlohmann::json line = {{"step", m.step}, {"loss", m.loss}, {"reconstruction", m.reconstruction},
                         {"quantizer", m.quantizer}, {"learning_rate", m.learning_rate}};
  if (model->gumbel && !decoder_only()) line["temperature"] = m.temperature;
  if (model->vector && !decoder_only()) line["restarted"] = m.restarted;
  if (discriminator) {
    line["adversarial"] = m.adversarial;
    line["adversarial_weight"] = m.adversarial_weight;
    line["discriminator"] = m.discriminator;
  }
  append_metrics(line);
}

void VqganTrainer::run() {
  auto& s = *state_;
  detail::run_image_training_loop<VqganStepMetrics>(s, [&](const VqganStepMetrics& metrics) {
    detail::log_tokenizer_validation("vqgan", s.step, metrics.loss, validate());
  });
}

TokenizerValidation VqganTrainer::validate() {
  auto& s = *state_;
  s.ema->copy_to(*s.ema_model);
  s.ema_model->eval();
  return detail::validate_tokenizer(*s.ema_model, *s.images.validation, s.config.data.batch_size, s.config.grid_images,
                                    s);
}

void VqganTrainer::State::save_extra(io::Checkpoint& checkpoint) const {
  auto& state = checkpoint.state;
  if (discriminator) {
    for (const auto& [name, tensor] : io::state_dict(*discriminator)) state.emplace("discriminator." + name, tensor);
    for (const auto& [name, tensor] : adamw_state(*discriminator_optimizer, *discriminator)) {
      state.emplace("discriminator_adamw." + name, tensor);
    }
  }
  state.emplace("vq.usage", usage);
  state.emplace("rng.noise", noise.get_state());
  if (discriminator_precision) discriminator_precision->save_state(state, "discriminator_gradient_scaler.");
}

void VqganTrainer::State::restore_extra(const io::Checkpoint& checkpoint, const std::string& directory) {
  const auto& state = checkpoint.state;
  if (discriminator) {
    io::load_state_dict(*discriminator, io::with_prefix_removed(state, "discriminator."),
                        directory + "/state.safetensors (discriminator.*)");
    load_adamw_state(*discriminator_optimizer, *discriminator,
                     io::with_prefix_removed(state, "discriminator_adamw."));
  }
  usage.copy_(state.at("vq.usage"));
  restore_generator(noise, state.at("rng.noise"), "vqgan");
  if (discriminator_precision) discriminator_precision->load_state(state, "discriminator_gradient_scaler.");
}

}  // namespace dalle::train
