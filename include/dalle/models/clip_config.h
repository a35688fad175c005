#pragma once
// The sizes of a CLIP model (a ViT image tower and a causal text transformer), and how its
// images are prepared. The defaults are OpenAI's ViT-B/32.
#include <cstdint>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/models/clip_transformer.h"

namespace dalle::models {

struct ClipConfig {
  int64_t embed_dim = 512;  // width of the joint embedding both towers project to
  int64_t image_size = 224;
  int64_t patch_size = 32;
  int64_t vision_width = 768;
  int64_t vision_layers = 12;
  int64_t vision_heads = 12;
  int64_t context_length = 77;
  int64_t vocab_size = 49408;
  int64_t text_width = 512;
  int64_t text_layers = 12;
  int64_t text_heads = 8;
  double mlp_ratio = 4.0;
  std::string activation = "quick_gelu";
  std::string text_pooling = "argmax";
  int64_t eos_id = 3;  // our SentencePiece tokenizer's end of text (text::Tokenizer::kEndId)
  double init_logit_scale = 2.659260036932778;  // ln(1 / 0.07)
  // How clip_preprocess brings images to image_size: "open_clip" (resize the shorter side,
  // then crop) or "ruclip" (crop the centred square, then resize); see clip.h.
  std::string preprocess = "open_clip";
  std::vector<double> image_mean{0.48145466, 0.4578275, 0.40821073};  // per channel, CLIP's
  std::vector<double> image_std{0.26862954, 0.26130258, 0.27577711};

  void visit(ConfigVisitor& v);
  // Throws when the values are inconsistent with each other.
  void validate() const;
  int64_t grid_size() const { return image_size / patch_size; }
  // Class token plus one per patch.
  int64_t vision_tokens() const { return grid_size() * grid_size() + 1; }
  // open_clip's int(width * mlp_ratio).
  int64_t vision_mlp_width() const { return static_cast<int64_t>(static_cast<double>(vision_width) * mlp_ratio); }
  int64_t text_mlp_width() const { return static_cast<int64_t>(static_cast<double>(text_width) * mlp_ratio); }
  ClipActivation activation_kind() const { return parse_clip_activation(activation); }
};

}  // namespace dalle::models
