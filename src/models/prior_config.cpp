#include "dalle/models/prior_config.h"

#include <string>

#include "dalle/error.h"
#include "dalle/models/attention_mask.h"

namespace dalle::models {

void PriorConfig::visit(ConfigVisitor& v) {
  v.field("text_length", text_length, "caption tokens, bos and eos included (DALL-E: 256, ruDALL-E: 128)",
          {.min = 2, .max = 4096});
  v.field("text_vocab_size", text_vocab_size,
          "caption BPE vocabulary; text_length position-unique padding ids follow it (DALL-E: 16384)",
          {.min = 4, .max = 1 << 20});
  v.field("grid_size", grid_size, "side of the image token grid (32 for 256px images and an f8 tokenizer)",
          {.min = 1, .max = 256});
  v.field("image_vocab_size", image_vocab_size, "image tokenizer codebook size (DALL-E: 8192)",
          {.min = 2, .max = 1 << 20});
  v.field("layers", layers, "attention layers, each an attention resblock then an MLP resblock (DALL-E: 64)",
          {.min = 1, .max = 1024});
  v.field("width", width, "d_model (DALL-E: 3968, ruDALL-E XL: 2048)", {.min = 1, .max = 65536});
  v.field("heads", heads, "attention heads; width must divide by it (DALL-E: 62)", {.min = 1, .max = 1024});
  v.field("mlp_ratio", mlp_ratio, "MLP hidden width / width", {.min = 1, .max = 64});
  v.field("attention", attention,
          "attention kind per layer (causal, row, column, conv): none for layer_pattern's, one for every layer, or "
          "exactly one per layer",
          {.choices = {"causal", "row", "column", "conv"}});
  v.field("layer_pattern", layer_pattern,
          "the kinds when attention names none: dalle (the paper: column at layers 2, 6, 10, ..., the last conv, "
          "the rest row) or rudalle (its weights' rule: the same, but a last layer at 2, 6, 10, ... stays column)",
          {.choices = {"dalle", "rudalle"}});
  v.field("conv_kernel", conv_kernel, "side of the convolutional mask's neighbourhood (odd)", {.min = 1, .max = 255});
  v.field("conv_edges", conv_edges,
          "clamped: the conv neighbourhood stops at the grid's edges (ruDALL-E v3); wrap: it wraps around them "
          "(ruDALL-E v2)",
          {.choices = {"clamped", "wrap"}});
  v.field("attention_path", attention_path,
          "sparse: compute only the blocks a mask allows; dense: masked attention over the whole sequence "
          "(the reference)",
          {.choices = {"sparse", "dense"}});
  v.field("sandwich_norm", sandwich_norm, "a LayerNorm on each resblock's output before the residual add (ruDALL-E)");
  v.field("head_norm", head_norm, "a second LayerNorm between the final one and the logits (ruDALL-E)");
  v.field("gelu", gelu, "MLP activation: exact GELU, or the tanh approximation (ruDALL-E)",
          {.choices = {"exact", "tanh"}});
  v.field("dropout", dropout, "dropout on each resblock's output in training", {.min = 0.0, .max = 0.9});
  v.field("text_loss_weight", text_loss_weight, "weight of the text loss; the image loss gets the rest (DALL-E: 1/8)",
          {.min = 0.0, .max = 1.0});
}

void PriorConfig::validate() const {
  if (width % heads != 0) {
    throw Error("prior: width " + std::to_string(width) + " does not divide into " + std::to_string(heads) + " heads");
  }
  if (conv_kernel % 2 == 0) throw Error("prior: conv_kernel must be odd, not " + std::to_string(conv_kernel));
  models::layer_pattern(attention, layers, layer_pattern);  // throws on a bad pattern
}

}  // namespace dalle::models
