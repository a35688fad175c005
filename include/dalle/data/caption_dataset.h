#pragma once
// The generic image-caption dataset: a folder of images plus a captions file naming them.
//   captions.tsv    one "relative/image/path<TAB>caption" per line
//   captions.jsonl  one {"image": "...", "caption": "..."} or {"image": ..., "captions": [...]}
//                   per line; other keys (such as fashion-compose's ground truth) are ignored
// An image may have several captions (several lines, or a "captions" list). Empty captions,
// missing images and malformed lines are skipped and counted when the dataset is opened;
// images that turn out to be unreadable are skipped and counted when loaded. None stop a run.
#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "dalle/config.h"

namespace dalle::data {

// A training run's images and their batching: the same keys in every trainer on images.
struct ImageDataConfig {
  std::string train;       // image-caption dataset folder
  std::string validation;  // held-out images for PSNR and reconstruction grids
  int64_t image_size = 256;
  int64_t batch_size = 8;
  int64_t workers = 2;
  bool random_crop = false;

  void visit(ConfigVisitor& v) {
    v.field("train", train, "image-caption dataset folder to train on (required)");
    v.field("validation", validation, "dataset folder of held-out images for PSNR and grids (required)");
    v.field("image_size", image_size, "images are resized and cropped to this square side", {.min = 8, .max = 4096});
    v.field("batch_size", batch_size, "images per update", {.min = 1, .max = 1 << 16});
    v.field("workers", workers, "loader threads (0: load on the training thread)", {.min = 0, .max = 64});
    v.field("random_crop", random_crop, "crop at random places instead of the centre");
  }
};

struct ImageCaptionRecord {
  std::string image_path;  // absolute, or relative to the working directory
  std::vector<std::string> captions;
};

struct ImageCaptionExample {
  int64_t index = 0;
  torch::Tensor image;  // [3, H, W] in [0, 1]
  std::string caption;
};

struct DatasetReport {
  int64_t images = 0;
  int64_t captions = 0;
  int64_t skipped_empty_captions = 0;
  int64_t skipped_missing_images = 0;
  int64_t skipped_malformed_lines = 0;
  int64_t skipped_unreadable_images = 0;  // grows as images are loaded
  std::string summary() const;
};

struct ImageCaptionOptions {
  std::string captions_file = {};  // empty: <root>/captions.jsonl, else <root>/captions.tsv
  int64_t image_size = 0;     // > 0: resize the shorter side, then crop a square of this size
  bool random_crop = false;   // crop at a random place instead of the centre
};

class ImageCaptionDataset {
 public:
  using Example = ImageCaptionExample;

  static std::shared_ptr<ImageCaptionDataset> open(const std::string& root,
                                                   const ImageCaptionOptions& options = {});

  size_t size() const { return records_.size(); }
  const ImageCaptionRecord& record(size_t index) const { return records_.at(index); }
  // Loads image `index` with one of its captions drawn by `rng`; nullopt (counted) when the
  // image cannot be read.
  std::optional<ImageCaptionExample> get(size_t index, std::mt19937_64& rng) const;
  // The same with its caption number `caption`; `rng` places a random crop.
  std::optional<ImageCaptionExample> get(size_t index, size_t caption, std::mt19937_64& rng) const;
  DatasetReport report() const;
  const std::string& root() const { return root_; }

 private:
  ImageCaptionDataset() = default;

  std::string root_;
  ImageCaptionOptions options_;
  std::vector<ImageCaptionRecord> records_;
  DatasetReport index_report_;
  mutable std::atomic<int64_t> unreadable_{0};
};

// Decodes every image once (with progress), so that report() counts all unreadable ones.
void verify_images(const ImageCaptionDataset& dataset);

// Writes a labelled grid of `count` examples drawn by a seeded shuffle, captions under
// the pictures, scaled to `tile_size` pixels: the way to check that captions match images.
void write_sample_grid(const ImageCaptionDataset& dataset, const std::string& path, int64_t count,
                       uint64_t seed, int64_t tile_size = 128);

}  // namespace dalle::data
