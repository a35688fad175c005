#include "dalle/models/sparse_attention.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "dalle/error.h"

namespace dalle::models {

AttentionPath parse_attention_path(const std::string& word) {
  if (word == "dense") return AttentionPath::dense;
  if (word == "sparse") return AttentionPath::sparse;
  throw Error("unknown attention path '" + word + "' (expected dense or sparse)");
}

namespace {

using torch::indexing::Slice;

// Block of each image token when blocks are grid rows (raster) or grid columns.
torch::Tensor block_of(const torch::Tensor& image_index, int64_t width, bool column_blocks) {
  return column_blocks ? image_index.remainder(width) : image_index.div(width, "floor");
}

// The smallest window of key blocks, relative to the query's block, holding every key the
// image-to-image mask allows.
std::pair<int64_t, int64_t> block_offsets(const torch::Tensor& image_mask, int64_t width, bool column_blocks) {
  const auto pairs = image_mask.nonzero();  // [P, 2]: (query, key)
  const auto offsets = block_of(pairs.select(1, 1), width, column_blocks) -
                       block_of(pairs.select(1, 0), width, column_blocks);
  return {offsets.min().item<int64_t>(), offsets.max().item<int64_t>()};
}

BlockSparsePlan make_plan(const torch::Tensor& dense, const SequenceLayout& layout) {
  const int64_t text = layout.text_length, grid = layout.grid_size;
  const auto image_mask = dense.index({Slice(text), Slice(text)});
  BlockSparsePlan plan;
  auto [first, last] = block_offsets(image_mask, grid, false);
  auto [column_first, column_last] = block_offsets(image_mask, grid, true);
  if (column_last - column_first < last - first) {
    plan.column_blocks = true;
    first = column_first;
    last = column_last;
  }
  plan.first_offset = first;
  plan.last_offset = last;

  const int64_t window = plan.window_blocks();
  const auto query_block = torch::arange(grid).view({grid, 1, 1});
  const auto in_block = torch::arange(grid).view({1, grid, 1});
  const auto window_key = torch::arange(window * grid).view({1, 1, window * grid});
  const auto key_block = query_block + first + window_key.div(grid, "floor");
  const auto key_in_block = window_key.remainder(grid);
  const auto inside = key_block.ge(0).logical_and(key_block.lt(grid));
  const auto clamped = key_block.clamp(0, grid - 1);
  const auto query = plan.column_blocks ? in_block * grid + query_block : query_block * grid + in_block;
  const auto key = plan.column_blocks ? key_in_block * grid + clamped : clamped * grid + key_in_block;
  const auto allowed = image_mask.index({query.expand({grid, grid, 1}), key}).logical_and(inside);
  plan.bias = torch::zeros(allowed.sizes(), torch::kFloat32)
                  .masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity());
  return plan;
}

// [B, H, N, hd] image tokens -> [B, H, blocks, block length, hd].
torch::Tensor to_blocks(const torch::Tensor& x, int64_t grid, bool column_blocks) {
  auto blocks = x.view({x.size(0), x.size(1), grid, grid, x.size(3)});
  return column_blocks ? blocks.transpose(2, 3) : blocks;
}

// For each query block, the keys of its window of blocks: [B, H, blocks, window * block length, hd].
torch::Tensor key_windows(const torch::Tensor& blocks, const BlockSparsePlan& plan) {
  const auto sizes = blocks.sizes();
  const auto before = torch::zeros({sizes[0], sizes[1], -plan.first_offset, sizes[3], sizes[4]}, blocks.options());
  const auto after = torch::zeros({sizes[0], sizes[1], plan.last_offset, sizes[3], sizes[4]}, blocks.options());
  const auto padded = torch::cat({before, blocks, after}, 2);
  return padded.unfold(2, plan.window_blocks(), 1)  // [B, H, blocks, len, hd, window]
      .permute({0, 1, 2, 5, 3, 4})
      .reshape({sizes[0], sizes[1], sizes[2], plan.window_blocks() * sizes[3], sizes[4]});
}

torch::Tensor sparse_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const LayerMask& mask) {
  const auto& layout = mask.layout();
  const auto& plan = mask.plan();
  const int64_t text = layout.text_length, grid = layout.grid_size;
  const int64_t batch = q.size(0), heads = q.size(1), head_width = q.size(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_width));

  const auto text_keys = k.index({Slice(), Slice(), Slice(0, text)});
  const auto text_values = v.index({Slice(), Slice(), Slice(0, text)});
  const auto text_out = at::scaled_dot_product_attention(q.index({Slice(), Slice(), Slice(0, text)}), text_keys,
                                                         text_values, {}, 0.0, /*is_causal=*/true);

  const auto image = Slice(text, torch::indexing::None);
  const auto queries = to_blocks(q.index({Slice(), Slice(), image}), grid, plan.column_blocks) * scale;
  const auto keys = key_windows(to_blocks(k.index({Slice(), Slice(), image}), grid, plan.column_blocks), plan);
  const auto values = key_windows(to_blocks(v.index({Slice(), Slice(), image}), grid, plan.column_blocks), plan);
  const auto text_scores =
      torch::matmul(queries.flatten(2, 3), text_keys.transpose(-1, -2)).view({batch, heads, grid, grid, text});
  const auto image_scores = torch::matmul(queries, keys.transpose(-1, -2)) + plan.bias.to(q.options());
  const auto probabilities = torch::softmax(torch::cat({text_scores, image_scores}, -1), -1);
  const auto text_part = torch::matmul(probabilities.index({"...", Slice(0, text)}).flatten(2, 3), text_values)
                             .view({batch, heads, grid, grid, head_width});
  auto image_out = text_part + torch::matmul(probabilities.index({"...", Slice(text, torch::indexing::None)}), values);
  if (plan.column_blocks) image_out = image_out.transpose(2, 3);
  return torch::cat({text_out, image_out.reshape({batch, heads, grid * grid, head_width})}, 2);
}

}  // namespace

LayerMask::LayerMask(MaskSpec spec, SequenceLayout layout)
    : spec_(spec), layout_(layout), dense_(dense_mask(spec, layout)), plan_(make_plan(dense_, layout)) {}

torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const LayerMask& mask, int64_t query_start, AttentionPath path) {
  const int64_t length = mask.layout().length();
  if (path == AttentionPath::sparse && query_start == 0 && q.size(2) == length && k.size(2) == length) {
    return sparse_attention(q, k, v, mask);
  }
  if (query_start + q.size(2) > length || k.size(2) > length) {
    throw Error("attention: positions beyond the sequence length " + std::to_string(length));
  }
  const auto visible = mask.dense()
                           .index({Slice(query_start, query_start + q.size(2)), Slice(0, k.size(2))})
                           .to(q.device());
  return at::scaled_dot_product_attention(q, k, v, visible);
}

}  // namespace dalle::models
