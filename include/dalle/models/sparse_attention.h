#pragma once
// The two attention paths over [text | image] sequences. The dense path is the reference:
// scaled-dot-product attention under the full [L, L] mask. The block-sparse path splits
// the image tokens into blocks of one grid line (a row, or a column when that makes the
// windows narrower), and lets each query block score only the text and the few key blocks
// its mask can reach; within those it applies the exact mask, so both paths agree.
#include <torch/types.h>

#include <cstdint>
#include <memory>

#include "dalle/models/attention_mask.h"

namespace dalle::models {

enum class AttentionPath { dense, sparse };
AttentionPath parse_attention_path(const std::string& word);

// Which key blocks each image query block needs, and the exact mask inside them.
struct BlockSparsePlan {
  bool column_blocks = false;  // blocks are grid columns (image tokens taken column-major)
  int64_t first_offset = 0;    // key blocks [query block + first_offset, query block + last_offset]
  int64_t last_offset = 0;
  torch::Tensor bias;          // [blocks, block length, window keys] float, 0 or -inf
  int64_t window_blocks() const { return last_offset - first_offset + 1; }
};

// One layer's mask in both forms, built once per (spec, layout) and shared by layers.
class LayerMask {
 public:
  LayerMask(MaskSpec spec, SequenceLayout layout);
  const MaskSpec& spec() const { return spec_; }
  const SequenceLayout& layout() const { return layout_; }
  const torch::Tensor& dense() const { return dense_; }  // [L, L] bool
  const BlockSparsePlan& plan() const { return plan_; }

 private:
  MaskSpec spec_;
  SequenceLayout layout_;
  torch::Tensor dense_;
  BlockSparsePlan plan_;
};

// q: [B, H, nq, hd] at positions [query_start, query_start + nq); k, v: [B, H, nk, hd] at
// positions [0, nk). The sparse path needs the whole sequence (query_start 0, nq = nk = L)
// and takes the dense one otherwise.
torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const LayerMask& mask, int64_t query_start, AttentionPath path);

}  // namespace dalle::models
