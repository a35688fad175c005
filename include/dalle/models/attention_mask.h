#pragma once
// DALL-E's attention masks over the sequence [text tokens | image tokens in raster order].
// Text attends causally to text; every image token attends to all text; image-to-image
// attention is causal and further restricted per layer to a row, column or convolutional
// neighbourhood. `attends` is the single definition: the dense masks, the block-sparse
// plans and the KV-cached decoding all derive from it.
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dalle::models {

enum class AttentionKind { causal, row, column, convolutional };

// "causal", "row", "column", "conv"; throws dalle::Error naming the accepted words.
AttentionKind parse_attention_kind(const std::string& word);
std::string to_string(AttentionKind kind);

// How the convolutional neighbourhood treats the edges of the grid: `clamped` cuts it off
// there (ruDALL-E's v3), `wrap` wraps it over them as on a torus (ruDALL-E's v2). Both stay
// causal in raster order.
enum class ConvEdges { clamped, wrap };
ConvEdges parse_conv_edges(const std::string& word);

struct SequenceLayout {
  int64_t text_length = 0;
  int64_t grid_size = 0;  // image tokens form a grid_size x grid_size grid
  int64_t image_length() const { return grid_size * grid_size; }
  int64_t length() const { return text_length + image_length(); }
};

struct MaskSpec {
  AttentionKind kind = AttentionKind::causal;
  int64_t conv_kernel = 11;  // odd; the neighbourhood reaches kernel / 2 rows up and columns aside
  ConvEdges conv_edges = ConvEdges::clamped;
};

// Whether the token at sequence position `query` may attend to the one at `key`.
bool attends(const MaskSpec& spec, const SequenceLayout& layout, int64_t query, int64_t key);

// [length, length] bool, true where attention is allowed.
torch::Tensor dense_mask(const MaskSpec& spec, const SequenceLayout& layout);

// The paper's pattern: the last layer is convolutional; layer i (1-based) is column when
// (i - 2) mod 4 == 0, otherwise row.
std::vector<AttentionKind> dalle_layer_pattern(int64_t layers);

// ruDALL-E's (DalleTransformer._get_layer_mask): the paper's, except that the column test
// comes before the last-layer test, so that 2, 6, 10, ... layers end with a column layer and
// have no conv layer. Its weights were trained with it.
std::vector<AttentionKind> rudalle_layer_pattern(int64_t layers);

// The layer kinds a config names: none -> the pattern of `rule` ("dalle" or "rudalle"), one
// -> every layer, else exactly `layers` of them.
std::vector<AttentionKind> layer_pattern(const std::vector<std::string>& words, int64_t layers,
                                         const std::string& rule);

}  // namespace dalle::models
