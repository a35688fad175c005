#pragma once
// The token dataset stage 2 trains on, written by dalle-encode-images: a folder of shards
//   shard-00000.safetensors   image_tokens [N, h, w], text_tokens [C, L], caption_image [C]
//                             (int16 when the vocabularies fit, else int32)
//   shard-00000.jsonl         the C captions as text, one JSON string a line, so that
//                             training can re-encode them with BPE-dropout
//   dataset.json              vocab sizes, grid, text length, shard count, what made it
// Every caption is one example: its ids, its image's tokens, and its text.
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace dalle::data {

struct TokenDatasetInfo {
  int64_t image_vocab_size = 0;
  int64_t text_vocab_size = 0;
  int64_t grid_height = 0, grid_width = 0;
  int64_t text_length = 0;
  int64_t images = 0, captions = 0, shards = 0;
  std::string source;  // free text: what the tokens were made from
};

struct TokenExample {
  int64_t index = 0;
  torch::Tensor image_tokens;  // [h, w] int64
  torch::Tensor text_tokens;   // [L] int64
  std::string caption;
};

// Appends images and their captions, cutting a new shard every `images_per_shard` images.
// Shards are written to a temporary sibling folder that finish() renames into place, so an
// interrupted run leaves the previous dataset (if any) intact; a folder that is not a
// token dataset is never replaced. Destroyed unfinished, the writer removes its shards.
class TokenDatasetWriter {
 public:
  TokenDatasetWriter(std::string directory, TokenDatasetInfo info, int64_t images_per_shard = 4096);
  ~TokenDatasetWriter();
  // `image_tokens` [h, w]; one row of `text_tokens` [C, L] and one text per caption.
  void add(const torch::Tensor& image_tokens, const torch::Tensor& text_tokens,
           const std::vector<std::string>& captions);
  // Writes the last shard and dataset.json; the folder is complete only after this.
  TokenDatasetInfo finish();

 private:
  void flush();
  std::string target_;
  std::string directory_;  // a temporary sibling of target_, renamed into place by finish()
  TokenDatasetInfo info_;
  int64_t images_per_shard_;
  std::vector<torch::Tensor> images_, texts_;
  std::vector<int64_t> caption_image_;
  std::vector<std::string> captions_;
  bool finished_ = false;
};

class TokenDataset {
 public:
  using Example = TokenExample;
  static std::shared_ptr<TokenDataset> open(const std::string& directory);

  size_t size() const { return static_cast<size_t>(text_tokens_.size(0)); }
  std::optional<TokenExample> get(size_t index, std::mt19937_64& rng) const;
  const TokenDatasetInfo& info() const { return info_; }

 private:
  TokenDatasetInfo info_;
  torch::Tensor image_tokens_, text_tokens_, caption_image_;
  std::vector<std::string> captions_;
};

}  // namespace dalle::data
