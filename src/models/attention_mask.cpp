#include "dalle/models/attention_mask.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>

#include "dalle/error.h"

namespace dalle::models {

AttentionKind parse_attention_kind(const std::string& word) {
  if (word == "causal") return AttentionKind::causal;
  if (word == "row") return AttentionKind::row;
  if (word == "column") return AttentionKind::column;
  if (word == "conv") return AttentionKind::convolutional;
  throw Error("unknown attention kind '" + word + "' (expected causal, row, column or conv)");
}

std::string to_string(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::causal: return "causal";
    case AttentionKind::row: return "row";
    case AttentionKind::column: return "column";
    case AttentionKind::convolutional: return "conv";
  }
  return "?";
}

ConvEdges parse_conv_edges(const std::string& word) {
  if (word == "clamped") return ConvEdges::clamped;
  if (word == "wrap") return ConvEdges::wrap;
  throw Error("unknown convolutional mask edges '" + word + "' (expected clamped or wrap)");
}

namespace {

bool image_attends(const MaskSpec& spec, int64_t width, int64_t query, int64_t key) {
  const int64_t back = query - key;  // raster distance, >= 0
  const int64_t query_row = query / width, key_row = key / width;
  const int64_t query_column = query % width, key_column = key % width;
  const int64_t reach = spec.conv_kernel / 2;
  switch (spec.kind) {
    case AttentionKind::causal: return true;
    case AttentionKind::row: return back <= width;
    case AttentionKind::column: return back % width == 0;
    case AttentionKind::convolutional:
      if (spec.conv_edges == ConvEdges::wrap) {
        // Distances on the torus: the neighbourhood wraps over the grid's edges, rows and columns.
        const auto torus = [width](int64_t d) {
          const int64_t forward = ((d % width) + width) % width;
          return std::min(forward, width - forward);
        };
        return torus(query_row - key_row) <= reach && torus(query_column - key_column) <= reach;
      }
      return query_row - key_row <= reach && std::abs(query_column - key_column) <= reach;
  }
  return false;
}

}  // namespace

bool attends(const MaskSpec& spec, const SequenceLayout& layout, int64_t query, int64_t key) {
  if (key < 0 || key > query || query >= layout.length()) return false;
  const int64_t text = layout.text_length;
  if (key < text) return true;  // text is causal, and every image token sees all text
  return image_attends(spec, layout.grid_size, query - text, key - text);
}

torch::Tensor dense_mask(const MaskSpec& spec, const SequenceLayout& layout) {
  const int64_t length = layout.length();
  auto mask = torch::zeros({length, length}, torch::kBool);
  auto access = mask.accessor<bool, 2>();
  for (int64_t query = 0; query < length; ++query) {
    for (int64_t key = 0; key <= query; ++key) access[query][key] = attends(spec, layout, query, key);
  }
  return mask;
}

std::vector<AttentionKind> dalle_layer_pattern(int64_t layers) {
  std::vector<AttentionKind> pattern;
  for (int64_t i = 1; i <= layers; ++i) {
    if (i == layers) {
      pattern.push_back(AttentionKind::convolutional);
    } else {
      pattern.push_back((i - 2) % 4 == 0 ? AttentionKind::column : AttentionKind::row);
    }
  }
  return pattern;
}

std::vector<AttentionKind> rudalle_layer_pattern(int64_t layers) {
  auto pattern = dalle_layer_pattern(layers);
  if ((layers - 2) % 4 == 0) pattern.back() = AttentionKind::column;
  return pattern;
}

std::vector<AttentionKind> layer_pattern(const std::vector<std::string>& words, int64_t layers,
                                         const std::string& rule) {
  if (words.empty() && rule == "rudalle") return rudalle_layer_pattern(layers);
  if (words.empty() && rule == "dalle") return dalle_layer_pattern(layers);
  if (words.empty()) throw Error("unknown layer pattern '" + rule + "' (expected dalle or rudalle)");
  if (words.size() == 1) return std::vector<AttentionKind>(layers, parse_attention_kind(words[0]));
  if (static_cast<int64_t>(words.size()) != layers) {
    throw Error("attention pattern names " + std::to_string(words.size()) + " layers but the model has " +
                std::to_string(layers) + " (give none for DALL-E's pattern, one for every layer, or one per layer)");
  }
  std::vector<AttentionKind> pattern;
  for (const auto& word : words) pattern.push_back(parse_attention_kind(word));
  return pattern;
}

}  // namespace dalle::models
