#include "dalle/data/token_dataset.h"

#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <tuple>

#include "dalle/error.h"
#include "dalle/io/atomic_file.h"
#include "dalle/io/stale_temporaries.h"
#include "dalle/io/safetensors.h"

namespace dalle::data {
namespace fs = std::filesystem;

namespace {

std::string shard_stem(int64_t shard) {
  char name[32];
  std::snprintf(name, sizeof name, "shard-%05lld", static_cast<long long>(shard));
  return name;
}

torch::ScalarType compact_type(int64_t vocab_size) {
  return vocab_size <= 32767 ? torch::kInt16 : torch::kInt32;
}

}  // namespace

TokenDatasetWriter::TokenDatasetWriter(std::string directory, TokenDatasetInfo info, int64_t images_per_shard)
    : target_(std::move(directory)),
      directory_(io::temporary_sibling(target_)),
      info_(std::move(info)),
      images_per_shard_(images_per_shard) {
  if (images_per_shard < 1) throw Error("a shard must hold at least one image");
  // Only an earlier token dataset may be replaced, and only once the new one is complete.
  if (fs::exists(target_) && !fs::exists(fs::path(target_) / "dataset.json")) {
    throw Error(target_ + " exists and is not a token dataset; refusing to replace it");
  }
  io::remove_stale_temporaries(target_);
  fs::create_directories(directory_);
  info_.images = info_.captions = info_.shards = 0;
}

TokenDatasetWriter::~TokenDatasetWriter() {
  if (!finished_) {
    std::error_code ignored;
    fs::remove_all(directory_, ignored);
  }
}

void TokenDatasetWriter::add(const torch::Tensor& image_tokens, const torch::Tensor& text_tokens,
                             const std::vector<std::string>& captions) {
  if (image_tokens.dim() != 2 || image_tokens.size(0) != info_.grid_height || image_tokens.size(1) != info_.grid_width) {
    throw Error("token dataset: image tokens must be a [" + std::to_string(info_.grid_height) + ", " +
                std::to_string(info_.grid_width) + "] grid");
  }
  if (text_tokens.dim() != 2 || text_tokens.size(1) != info_.text_length ||
      text_tokens.size(0) != static_cast<int64_t>(captions.size()) || captions.empty()) {
    throw Error("token dataset: text tokens must be [captions, " + std::to_string(info_.text_length) +
                "], one row per caption");
  }
  const int64_t image = static_cast<int64_t>(images_.size());
  images_.push_back(image_tokens.to(compact_type(info_.image_vocab_size)));
  texts_.push_back(text_tokens.to(compact_type(info_.text_vocab_size)));
  for (const auto& caption : captions) {
    caption_image_.push_back(image);
    captions_.push_back(caption);
  }
  if (static_cast<int64_t>(images_.size()) == images_per_shard_) flush();
}

void TokenDatasetWriter::flush() {
  if (images_.empty()) return;
  const std::string stem = (fs::path(directory_) / shard_stem(info_.shards)).string();
  io::write_safetensors(stem + ".safetensors",
                        {{"image_tokens", torch::stack(images_)},
                         {"text_tokens", torch::cat(texts_)},
                         {"caption_image", torch::tensor(caption_image_, torch::kInt32)}});
  std::ostringstream lines;
  for (const auto& caption : captions_) {
    lines << nlohmann::json(caption).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  }
  io::write_file_atomic(stem + ".jsonl", lines.str());
  info_.images += static_cast<int64_t>(images_.size());
  info_.captions += static_cast<int64_t>(captions_.size());
  ++info_.shards;
  images_.clear();
  texts_.clear();
  caption_image_.clear();
  captions_.clear();
}

TokenDatasetInfo TokenDatasetWriter::finish() {
  if (finished_) return info_;
  flush();
  finished_ = true;
  const nlohmann::json description = {
      {"format", "dalle-tokens-1"},          {"image_vocab_size", info_.image_vocab_size},
      {"text_vocab_size", info_.text_vocab_size}, {"grid", {info_.grid_height, info_.grid_width}},
      {"text_length", info_.text_length},    {"images", info_.images},
      {"captions", info_.captions},          {"shards", info_.shards},
      {"source", info_.source}};
  io::write_file_atomic((fs::path(directory_) / "dataset.json").string(),
                        description.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  std::optional<std::string> previous;
  if (fs::exists(target_)) {
    previous = io::temporary_sibling(target_);
    fs::rename(target_, *previous);
  }
  fs::rename(directory_, target_);
  if (previous) fs::remove_all(*previous);
  return info_;
}

std::shared_ptr<TokenDataset> TokenDataset::open(const std::string& directory) {
  const fs::path root(directory);
  std::ifstream in(root / "dataset.json");
  if (!in) throw Error(directory + ": no dataset.json (not a token dataset, or its writing did not finish)");
  const auto description = nlohmann::json::parse(in, nullptr, false);
  if (!description.is_object() || description.value("format", "") != "dalle-tokens-1") {
    throw Error(directory + "/dataset.json: not a dalle-tokens-1 description");
  }
  auto dataset = std::shared_ptr<TokenDataset>(new TokenDataset());
  auto& info = dataset->info_;
  try {
    info.image_vocab_size = description.at("image_vocab_size");
    info.text_vocab_size = description.at("text_vocab_size");
    info.grid_height = description.at("grid").at(0);
    info.grid_width = description.at("grid").at(1);
    info.text_length = description.at("text_length");
    info.shards = description.at("shards");
    info.source = description.value("source", "");
  } catch (const nlohmann::json::exception& error) {
    throw Error(directory + "/dataset.json: " + error.what());
  }
  std::vector<torch::Tensor> images, texts, owners;
  int64_t image_offset = 0;
  for (int64_t shard = 0; shard < info.shards; ++shard) {
    const std::string stem = (root / shard_stem(shard)).string();
    auto tensors = io::read_safetensors(stem + ".safetensors").tensors;
    for (const char* name : {"image_tokens", "text_tokens", "caption_image"}) {
      if (!tensors.count(name)) throw Error(stem + ".safetensors: no '" + name + "' tensor");
    }
    const auto& image_tokens = tensors.at("image_tokens");
    const auto& text_tokens = tensors.at("text_tokens");
    const auto& owner = tensors.at("caption_image");
    // Ids reach embedding lookups: a corrupt shard must stop here, not in a CUDA kernel.
    for (const auto& [tensor, vocab, what] : {std::tuple{image_tokens, info.image_vocab_size, "image_tokens"},
                                              std::tuple{text_tokens, info.text_vocab_size, "text_tokens"}}) {
      if (!c10::isIntegralType(tensor.scalar_type(), /*includeBool=*/false)) {
        throw Error(stem + ".safetensors: '" + what + "' must hold integers");
      }
      if (tensor.numel() > 0 && (tensor.min().item<int64_t>() < 0 || tensor.max().item<int64_t>() >= vocab)) {
        throw Error(stem + ".safetensors: '" + what + "' holds ids outside [0, " + std::to_string(vocab) + ")");
      }
    }
    if (image_tokens.dim() != 3 || image_tokens.size(1) != info.grid_height || image_tokens.size(2) != info.grid_width ||
        text_tokens.dim() != 2 || text_tokens.size(1) != info.text_length || owner.dim() != 1 ||
        owner.size(0) != text_tokens.size(0) ||
        (owner.numel() > 0 && (owner.min().item<int64_t>() < 0 || owner.max().item<int64_t>() >= image_tokens.size(0)))) {
      throw Error(stem + ".safetensors: shapes disagree with dataset.json");
    }
    std::ifstream lines(stem + ".jsonl");
    int64_t read = 0;
    for (std::string line; std::getline(lines, line); ++read) {
      auto caption = nlohmann::json::parse(line, nullptr, false);
      if (!caption.is_string()) throw Error(stem + ".jsonl:" + std::to_string(read + 1) + ": not a JSON string");
      dataset->captions_.push_back(caption.get<std::string>());
    }
    if (read != text_tokens.size(0)) throw Error(stem + ".jsonl: caption count differs from the shard's");
    images.push_back(image_tokens.to(torch::kInt64));
    texts.push_back(text_tokens.to(torch::kInt64));
    owners.push_back(owner.to(torch::kInt64) + image_offset);
    image_offset += image_tokens.size(0);
  }
  if (images.empty()) throw Error(directory + ": the token dataset holds no shard");
  dataset->image_tokens_ = torch::cat(images);
  dataset->text_tokens_ = torch::cat(texts);
  dataset->caption_image_ = torch::cat(owners);
  info.images = dataset->image_tokens_.size(0);
  info.captions = dataset->text_tokens_.size(0);
  return dataset;
}

std::optional<TokenExample> TokenDataset::get(size_t index, std::mt19937_64&) const {
  const auto i = static_cast<int64_t>(index);
  return TokenExample{i, image_tokens_[caption_image_[i].item<int64_t>()], text_tokens_[i], captions_.at(index)};
}

}  // namespace dalle::data
