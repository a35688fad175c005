#include "dalle/models/rudalle_import.h"

#include <torch/torch.h>

#include <map>
#include <string>

#include "dalle/error.h"

namespace dalle::models {
using torch::indexing::Slice;

io::TensorMap import_rudalle_state(const io::TensorMap& rudalle, const PriorConfig& config) {
  if (config.attention.empty() && config.layer_pattern != "rudalle") {
    throw Error("ruDALL-E import: the model needs layer_pattern: rudalle, the rule its weights were trained with "
                "(with 2, 6, 10, ... layers its last layer is column, not conv)");
  }
  std::map<std::string, std::string> names = {
      {"text_embeddings.weight", "text_embedding.weight"},
      {"image_embeddings.weight", "image_embedding.weight"},
      {"image_row_embeddings.weight", "image_row_embedding.weight"},
      {"image_col_embeddings.weight", "image_column_embedding.weight"},
      {"transformer.final_layernorm.weight", "final_norm.weight"},
      {"transformer.final_layernorm.bias", "final_norm.bias"},
      {"to_logits.0.weight", "head_norm.weight"},
      {"to_logits.0.bias", "head_norm.bias"},
      {"to_logits.1.weight", "to_logits.weight"},
      {"to_logits.1.bias", "to_logits.bias"},
  };
  const std::pair<const char*, const char*> layer_names[] = {
      {"input_layernorm", "0.norm"},
      {"attention.query_key_value", "0.qkv"},
      {"attention.dense", "0.out"},
      {"before_first_addition_layernorm", "0.output_norm"},
      {"post_attention_layernorm", "1.norm"},
      {"mlp.dense_h_to_4h", "1.fc_in"},
      {"mlp.dense_4h_to_h", "1.fc_out"},
      {"before_second_addition_layernorm", "1.output_norm"},
  };
  for (int64_t layer = 0; layer < config.layers; ++layer) {
    for (const auto& [theirs, ours] : layer_names) {
      const std::string block = std::to_string(2 * layer + (ours[0] - '0'));
      for (const char* kind : {".weight", ".bias"}) {
        names["transformer.layers." + std::to_string(layer) + "." + theirs + kind] =
            "resblocks." + block + (ours + 1) + kind;
      }
    }
  }
  io::TensorMap ours;
  for (const auto& [name, tensor] : rudalle) {
    if (name.starts_with("transformer.") && name.ends_with("_mask")) continue;  // rebuilt from the config
    if (name == "text_pos_embeddings.weight") {
      // ruDALL-E keeps text_length + 1 rows; v3 models never use the last.
      ours["text_position_embedding.weight"] = tensor.index({Slice(0, config.text_length)});
      continue;
    }
    const auto it = names.find(name);
    if (it == names.end()) throw Error("ruDALL-E import: unexpected tensor '" + name + "'");
    ours[it->second] = tensor;
  }
  return ours;
}

}  // namespace dalle::models
