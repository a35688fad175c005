#include "dalle/models/clip.h"

#include <torch/torch.h>

#include <cfenv>
#include <cmath>
#include <sstream>
#include <vector>

#include "dalle/error.h"

namespace dalle::models {
namespace F = torch::nn::functional;

namespace {

std::string shape_of(const torch::Tensor& tensor) {
  std::ostringstream out;
  out << tensor.sizes();
  return out.str();
}

// Python's round(): halves go to the even neighbour (torchvision's CenterCrop uses it).
int64_t round_half_even(double value) {
  const int previous = std::fegetround();
  std::fesetround(FE_TONEAREST);
  const double rounded = std::nearbyint(value);
  std::fesetround(previous);
  return static_cast<int64_t>(rounded);
}

}  // namespace

void ClipConfig::visit(ConfigVisitor& v) {
  v.field("embed_dim", embed_dim, "width of the joint embedding both towers project to (ViT-B/32: 512)",
          {.min = 1, .max = 65536});
  v.field("image_size", image_size, "side of the square images the image tower reads (ViT-B/32: 224)",
          {.min = 1, .max = 65536});
  v.field("patch_size", patch_size, "side of a patch; image_size must be a multiple (ViT-B/32: 32)",
          {.min = 1, .max = 65536});
  v.field("vision_width", vision_width, "width of the image transformer (ViT-B/32: 768)", {.min = 1, .max = 65536});
  v.field("vision_layers", vision_layers, "residual attention blocks of the image transformer (ViT-B/32: 12)",
          {.min = 0, .max = 1024});
  v.field("vision_heads", vision_heads,
          "attention heads of the image transformer; open_clip uses vision_width / 64 (ViT-B/32: 12)",
          {.min = 1, .max = 4096});
  v.field("context_length", context_length, "text positions, the longest token sequence (CLIP: 77)",
          {.min = 1, .max = 65536});
  v.field("vocab_size", vocab_size,
          "text vocabulary (CLIP's BPE: 49408; ours: the SentencePiece tokenizer's vocab_size)",
          {.min = 2, .max = 1 << 24});
  v.field("text_width", text_width, "width of the text transformer (ViT-B/32: 512)", {.min = 1, .max = 65536});
  v.field("text_layers", text_layers, "residual attention blocks of the text transformer (ViT-B/32: 12)",
          {.min = 0, .max = 1024});
  v.field("text_heads", text_heads, "attention heads of the text transformer (ViT-B/32: 8)", {.min = 1, .max = 4096});
  v.field("mlp_ratio", mlp_ratio, "MLP hidden width over the transformer width, both towers (CLIP: 4)",
          {.min = 0.0, .max = 64.0});
  v.field("activation", activation,
          "MLP activation: quick_gelu (x * sigmoid(1.702 x), OpenAI's released weights) or gelu (erf GELU, "
          "open_clip's default for models it trains)",
          {.choices = {"quick_gelu", "gelu"}});
  v.field("text_pooling", text_pooling,
          "which position's feature represents a caption: argmax (the largest token id, CLIP's end-of-text "
          "token) or eos (the first eos_id, for our SentencePiece tokenizer)",
          {.choices = {"argmax", "eos"}});
  v.field("eos_id", eos_id, "end-of-text id that eos pooling looks for (our tokenizer: 3)", {.min = 0});
  v.field("init_logit_scale", init_logit_scale,
          "initial logit_scale, the log of the inverse softmax temperature (CLIP: ln(1 / 0.07))",
          {.min = 0.0, .max = 10.0});
  v.field("preprocess", preprocess,
          "how images are brought to image_size: open_clip (the shorter side resized to image_size, bicubic, "
          "then the centred square; OpenAI CLIP, open_clip, dalle-train-clip) or ruclip (the centred square of the "
          "shorter side, then resized to image_size, bilinear; ruCLIP's processor)",
          {.choices = {"open_clip", "ruclip"}});
  v.field("image_mean", image_mean, "per-channel mean (R, G, B) subtracted from [0, 1] pixels (CLIP's)",
          {.min = 0.0, .max = 1.0});
  v.field("image_std", image_std, "per-channel standard deviation (R, G, B) the pixels are divided by (CLIP's)",
          {.min = 1e-6, .max = 10.0});
}

void ClipConfig::validate() const {
  if (image_size % patch_size != 0) {
    throw Error("clip: image_size (" + std::to_string(image_size) + ") must be a multiple of patch_size (" +
                std::to_string(patch_size) + ")");
  }
  if (vision_width % vision_heads != 0) {
    throw Error("clip: vision_width (" + std::to_string(vision_width) + ") must be a multiple of vision_heads (" +
                std::to_string(vision_heads) + ")");
  }
  if (text_width % text_heads != 0) {
    throw Error("clip: text_width (" + std::to_string(text_width) + ") must be a multiple of text_heads (" +
                std::to_string(text_heads) + ")");
  }
  if (vision_mlp_width() < 1 || text_mlp_width() < 1) {
    throw Error("clip: mlp_ratio (" + std::to_string(mlp_ratio) + ") leaves an MLP without hidden units");
  }
  if (text_pooling != "argmax" && text_pooling != "eos") {
    throw Error("clip: text_pooling must be 'argmax' or 'eos', got '" + text_pooling + "'");
  }
  if (text_pooling == "eos" && (eos_id < 0 || eos_id >= vocab_size)) {
    throw Error("clip: eos_id (" + std::to_string(eos_id) + ") is outside the vocabulary of " +
                std::to_string(vocab_size));
  }
  if (preprocess != "open_clip" && preprocess != "ruclip") {
    throw Error("clip: preprocess must be 'open_clip' or 'ruclip', got '" + preprocess + "'");
  }
  if (image_mean.size() != 3 || image_std.size() != 3) {
    throw Error("clip: image_mean and image_std need 3 values each (R, G, B), got " +
                std::to_string(image_mean.size()) + " and " + std::to_string(image_std.size()));
  }
  for (const double deviation : image_std) {
    if (!(deviation > 0.0)) throw Error("clip: image_std values must be positive");
  }
  parse_clip_activation(activation);
}

namespace {

void check_images(const torch::Tensor& images, int64_t image_size) {
  if (images.dim() != 4 || images.size(1) != 3 || images.size(2) < 1 || images.size(3) < 1) {
    throw Error("clip_preprocess: expected images [batch, 3, H, W] in [0, 1], got " + shape_of(images));
  }
  if (!images.is_floating_point()) {
    throw Error("clip_preprocess: expected floating-point images in [0, 1], got " +
                std::string(c10::toString(images.scalar_type())));
  }
  if (image_size < 1) throw Error("clip_preprocess: image_size must be positive");
}

// torchvision's tensor resize: half-pixel centres, antialiased when it shrinks.
torch::Tensor resize(const torch::Tensor& x, int64_t height, int64_t width, F::InterpolateFuncOptions::mode_t mode) {
  return F::interpolate(x, F::InterpolateFuncOptions()
                               .size(std::vector<int64_t>{height, width})
                               .mode(mode)
                               .align_corners(false)
                               .antialias(true));
}

// open_clip: Resize(image_size) then CenterCrop(image_size).
torch::Tensor resize_then_crop(torch::Tensor x, int64_t image_size) {
  int64_t height = x.size(2), width = x.size(3);
  // torchvision's Resize(int): the shorter side becomes image_size, the longer one
  // int(image_size * long / short); nothing happens when the size is already right.
  const int64_t shorter = std::min(height, width), longer = std::max(height, width);
  const auto new_longer = static_cast<int64_t>(static_cast<double>(image_size * longer) / static_cast<double>(shorter));
  const int64_t new_height = height <= width ? image_size : new_longer;
  const int64_t new_width = height <= width ? new_longer : image_size;
  if (new_height != height || new_width != width) {
    x = resize(x, new_height, new_width, torch::kBicubic);
    height = new_height;
    width = new_width;
  }
  // CenterCrop: offsets rounded half to even, as Python's round.
  const int64_t top = round_half_even(static_cast<double>(height - image_size) / 2.0);
  const int64_t left = round_half_even(static_cast<double>(width - image_size) / 2.0);
  return x.slice(2, top, top + image_size).slice(3, left, left + image_size);
}

// ruclip: RandomResizedCrop(image_size, scale=(1, 1), ratio=(1, 1)). Its square of the whole
// area fits only a square image (or one a pixel longer one way); otherwise torchvision falls
// back to the centred crop of ratio 1, offsets (long - short) // 2.
torch::Tensor crop_then_resize(torch::Tensor x, int64_t image_size) {
  const int64_t height = x.size(2), width = x.size(3), side = std::min(height, width);
  const int64_t top = (height - side) / 2, left = (width - side) / 2;
  x = x.slice(2, top, top + side).slice(3, left, left + side);
  return side == image_size ? x : resize(x, image_size, image_size, torch::kBilinear);
}

torch::Tensor normalise(const torch::Tensor& x, const std::vector<double>& mean, const std::vector<double>& std) {
  const auto options = torch::TensorOptions().dtype(x.dtype()).device(x.device());
  return (x - torch::tensor(mean, options).view({1, 3, 1, 1})) / torch::tensor(std, options).view({1, 3, 1, 1});
}

}  // namespace

torch::Tensor clip_preprocess(const torch::Tensor& images, const ClipConfig& config) {
  if (images.dim() == 3) return clip_preprocess(images.unsqueeze(0), config).squeeze(0);
  check_images(images, config.image_size);
  if (config.image_mean.size() != 3 || config.image_std.size() != 3) {
    throw Error("clip_preprocess: image_mean and image_std need 3 values each (R, G, B)");
  }
  torch::Tensor x;
  if (config.preprocess == "open_clip") {
    x = resize_then_crop(images, config.image_size);
  } else if (config.preprocess == "ruclip") {
    x = crop_then_resize(images, config.image_size);
  } else {
    throw Error("clip_preprocess: preprocess must be 'open_clip' or 'ruclip', got '" + config.preprocess + "'");
  }
  return normalise(x, config.image_mean, config.image_std);
}

torch::Tensor clip_preprocess(const torch::Tensor& images, int64_t image_size) {
  ClipConfig config;
  config.image_size = image_size;
  config.image_mean.assign(kClipMean.begin(), kClipMean.end());
  config.image_std.assign(kClipStd.begin(), kClipStd.end());
  return clip_preprocess(images, config);
}

ClipImpl::ClipImpl(const ClipConfig& config) : config_(config) {
  config.validate();
  visual = register_module("visual", ClipVisionTransformer(config));
  token_embedding = register_module("token_embedding", torch::nn::Embedding(config.vocab_size, config.text_width));
  positional_embedding =
      register_parameter("positional_embedding", torch::empty({config.context_length, config.text_width}));
  transformer = register_module("transformer", ClipTransformer(config.text_width, config.text_layers, config.text_heads,
                                                               config.text_mlp_width(), config.activation_kind()));
  ln_final =
      register_module("ln_final", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.text_width}).eps(1e-5)));
  text_projection = register_parameter("text_projection", torch::empty({config.text_width, config.embed_dim}));
  logit_scale = register_parameter("logit_scale", torch::empty({}));
  reset_parameters();
}

void ClipImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const auto width = static_cast<double>(config_.text_width);
  const double attn_std = std::pow(width, -0.5);
  const auto layers = static_cast<double>(std::max<int64_t>(config_.text_layers, 1));
  const double proj_std = attn_std * std::pow(2.0 * layers, -0.5);
  const double fc_std = std::pow(2.0 * width, -0.5);
  torch::nn::init::normal_(token_embedding->weight, 0.0, 0.02);
  torch::nn::init::normal_(positional_embedding, 0.0, 0.01);
  for (auto& block : transformer->blocks()) {
    torch::nn::init::normal_(block->attn->in_proj_weight, 0.0, attn_std);
    torch::nn::init::normal_(block->attn->out_proj->weight, 0.0, proj_std);
    torch::nn::init::normal_(block->mlp->c_fc->weight, 0.0, fc_std);
    torch::nn::init::normal_(block->mlp->c_proj->weight, 0.0, proj_std);
  }
  torch::nn::init::normal_(text_projection, 0.0, attn_std);
  logit_scale.fill_(config_.init_logit_scale);
}

void ClipImpl::check_tokens(const torch::Tensor& tokens) const {
  if (tokens.dim() != 2 || tokens.scalar_type() != torch::kInt64) {
    throw Error("clip text tower: expected [batch, length] int64 token ids, got " + shape_of(tokens) + " " +
                std::string(c10::toString(tokens.scalar_type())));
  }
  if (tokens.size(1) < 1 || tokens.size(1) > config_.context_length) {
    throw Error("clip text tower: " + std::to_string(tokens.size(1)) + " tokens per caption, the model reads 1 to " +
                std::to_string(config_.context_length) + " (context_length)");
  }
  if (tokens.numel() > 0) {
    const auto low = tokens.min().item<int64_t>(), high = tokens.max().item<int64_t>();
    if (low < 0 || high >= config_.vocab_size) {
      throw Error("clip text tower: token id " + std::to_string(low < 0 ? low : high) +
                  " is outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
    }
  }
}

torch::Tensor ClipImpl::pooling_positions(const torch::Tensor& tokens) const {
  if (config_.text_pooling == "argmax") return tokens.argmax(1);  // the first largest id
  const auto is_eos = tokens == config_.eos_id;
  const auto found = is_eos.any(1);
  if (!found.all().item<bool>()) {
    const auto row = (~found).nonzero().select(1, 0)[0].item<int64_t>();
    throw Error("clip text tower: caption " + std::to_string(row) + " has no end-of-text id " +
                std::to_string(config_.eos_id) + " to pool at (text_pooling: eos)");
  }
  return is_eos.to(torch::kInt32).argmax(1);  // the first eos
}

torch::Tensor ClipImpl::encode_image(const torch::Tensor& images, bool normalize) {
  auto features = visual->forward(images);
  return normalize ? F::normalize(features, F::NormalizeFuncOptions().dim(-1)) : features;
}

torch::Tensor ClipImpl::encode_text(const torch::Tensor& tokens, bool normalize) {
  check_tokens(tokens);
  const int64_t length = tokens.size(1);
  auto x = token_embedding->forward(tokens) + positional_embedding.slice(0, 0, length);
  x = ln_final->forward(transformer->forward(x, /*causal=*/true));
  const auto rows = torch::arange(tokens.size(0), tokens.options());
  auto features = torch::matmul(x.index({rows, pooling_positions(tokens)}), text_projection);
  return normalize ? F::normalize(features, F::NormalizeFuncOptions().dim(-1)) : features;
}

ClipLogits ClipImpl::logits_from_features(const torch::Tensor& image_features,
                                          const torch::Tensor& text_features) const {
  const auto options = F::NormalizeFuncOptions().dim(-1);
  const auto images = F::normalize(image_features, options), texts = F::normalize(text_features, options);
  const auto per_image = logit_scale.exp() * torch::matmul(images, texts.t());
  return {per_image, per_image.t()};
}

ClipLogits ClipImpl::logits(const torch::Tensor& images, const torch::Tensor& tokens) {
  return logits_from_features(encode_image(images), encode_text(tokens));
}

}  // namespace dalle::models
