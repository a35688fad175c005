#include "dalle/data/caption_dataset.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dalle/data/image.h"
#include "dalle/data/image_grid.h"
#include "dalle/data/sampler.h"
#include "dalle/error.h"
#include "dalle/input_limits.h"
#include "dalle/log.h"

namespace dalle::data {
namespace fs = std::filesystem;

namespace {

bool is_blank(const std::string& text) {
  return text.find_first_not_of(" \t\r\n") == std::string::npos;
}

std::string trim(const std::string& text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return {};
  return text.substr(first, text.find_last_not_of(" \t\r\n") - first + 1);
}

constexpr const char* kLongLine =
    "a captions file holds one image and its captions per line (DALLE_MAX_TEXT_BYTES x 16384)";

// Image path -> captions, in first-seen order, gathered line by line.
struct Collector {
  std::vector<ImageCaptionRecord> records;
  std::map<std::string, size_t> position;
  DatasetReport report;
  int64_t warnings = 0;
  size_t caption_bytes = static_cast<size_t>(max_text_bytes());

  void warn(const std::string& where, const std::string& why, const std::string& outcome = "skipped") {
    if (warnings++ < 10) log::warn(where, ": ", why, "; ", outcome);
  }

  void add(const std::string& image, const std::string& caption, const std::string& where) {
    if (is_blank(caption)) {
      ++report.skipped_empty_captions;
      warn(where, "empty caption");
      return;
    }
    if (!is_valid_utf8(caption)) {
      ++report.skipped_malformed_lines;
      warn(where, "the caption is not valid UTF-8");
      return;
    }
    // A caption beyond any text length a model reads would only cost time and memory
    // downstream (tokenizing, grid labels).
    std::string kept = trim(caption);
    if (kept.size() > caption_bytes) {
      warn(where, "caption of " + std::to_string(kept.size()) + " bytes",
           "cut to " + std::to_string(caption_bytes) + " (DALLE_MAX_TEXT_BYTES)");
      kept = std::string(utf8_prefix(kept, caption_bytes));
    }
    auto [it, inserted] = position.try_emplace(image, records.size());
    if (inserted) records.push_back({image, {}});
    records[it->second].captions.push_back(std::move(kept));
  }
};

void read_tsv(std::istream& in, const fs::path& root, const std::string& name, Collector& collector) {
  std::string line;
  const auto limit = static_cast<size_t>(max_caption_line_bytes());
  for (int64_t number = 1; read_line_within(in, limit, line, name, number, kLongLine); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (is_blank(line)) continue;
    const std::string where = name + ":" + std::to_string(number);
    const auto tab = line.find('\t');
    if (tab == std::string::npos || tab == 0) {
      ++collector.report.skipped_malformed_lines;
      collector.warn(where, "expected '<image path><TAB><caption>'");
      continue;
    }
    collector.add((root / line.substr(0, tab)).string(), line.substr(tab + 1), where);
  }
}

void read_jsonl(std::istream& in, const fs::path& root, const std::string& name, Collector& collector) {
  std::string line;
  const auto limit = static_cast<size_t>(max_caption_line_bytes());
  for (int64_t number = 1; read_line_within(in, limit, line, name, number, kLongLine); ++number) {
    if (is_blank(line)) continue;
    const std::string where = name + ":" + std::to_string(number);
    auto entry = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const bool has_caption = entry.is_object() &&
        ((entry.contains("caption") && entry["caption"].is_string()) ||
         (entry.contains("captions") && entry["captions"].is_array()));
    if (!entry.is_object() || !entry.contains("image") || !entry["image"].is_string() || !has_caption) {
      ++collector.report.skipped_malformed_lines;
      collector.warn(where, "expected {\"image\": \"...\", \"caption\": \"...\"} or \"captions\": [...]");
      continue;
    }
    const std::string image = (root / entry["image"].get<std::string>()).string();
    if (entry.contains("caption")) {
      collector.add(image, entry["caption"].is_string() ? entry["caption"].get<std::string>() : std::string(), where);
    }
    if (entry.contains("captions")) {
      for (const auto& caption : entry["captions"]) {
        collector.add(image, caption.is_string() ? caption.get<std::string>() : std::string(), where);
      }
    }
  }
}

std::string find_captions_file(const fs::path& root, const std::string& given) {
  if (!given.empty()) return given;
  for (const char* name : {"captions.jsonl", "captions.tsv"}) {
    if (fs::exists(root / name)) return (root / name).string();
  }
  throw Error(root.string() + ": no captions.jsonl or captions.tsv in the dataset folder");
}

}  // namespace

std::string DatasetReport::summary() const {
  std::ostringstream out;
  out << images << " images, " << captions << " captions; skipped: " << skipped_empty_captions
      << " empty captions, " << skipped_missing_images << " missing images, "
      << skipped_malformed_lines << " malformed lines, " << skipped_unreadable_images
      << " unreadable images";
  return out.str();
}

std::shared_ptr<ImageCaptionDataset> ImageCaptionDataset::open(const std::string& root,
                                                               const ImageCaptionOptions& options) {
  if (!fs::is_directory(root)) throw Error(root + ": no such dataset folder");
  const std::string captions_file = find_captions_file(root, options.captions_file);
  std::ifstream in(captions_file);
  if (!in) throw Error(captions_file + ": cannot open the captions file");

  Collector collector;
  const bool jsonl = fs::path(captions_file).extension() == ".jsonl";
  if (jsonl) read_jsonl(in, root, captions_file, collector);
  else read_tsv(in, root, captions_file, collector);

  std::shared_ptr<ImageCaptionDataset> dataset(new ImageCaptionDataset());
  dataset->root_ = root;
  dataset->options_ = options;
  dataset->index_report_ = collector.report;
  for (auto& record : collector.records) {
    std::error_code unreachable;  // a name too long for the file system is a missing image too
    if (!fs::is_regular_file(record.image_path, unreachable)) {
      ++dataset->index_report_.skipped_missing_images;
      collector.warn(captions_file, "image " + excerpt(record.image_path, 200) + " does not exist");
      continue;
    }
    dataset->index_report_.captions += static_cast<int64_t>(record.captions.size());
    dataset->records_.push_back(std::move(record));
  }
  dataset->index_report_.images = static_cast<int64_t>(dataset->records_.size());
  if (dataset->records_.empty()) {
    throw Error(captions_file + ": no usable image-caption pairs (" + dataset->index_report_.summary() + ")");
  }
  return dataset;
}

std::optional<ImageCaptionExample> ImageCaptionDataset::get(size_t index, std::mt19937_64& rng) const {
  return get(index, rng() % records_.at(index).captions.size(), rng);
}

std::optional<ImageCaptionExample> ImageCaptionDataset::get(size_t index, size_t caption,
                                                            std::mt19937_64& rng) const {
  const auto& record = records_.at(index);
  ImageCaptionExample example;
  example.index = static_cast<int64_t>(index);
  example.caption = record.captions.at(caption);
  try {
    example.image = read_image(record.image_path);
  } catch (const ImageError& error) {
    if (unreadable_.fetch_add(1) < 10) log::warn(error.what(), "; skipped");
    return std::nullopt;
  }
  if (options_.image_size > 0) {
    example.image = resize_shorter_side(example.image, options_.image_size);
    example.image = options_.random_crop
        ? random_crop(example.image, options_.image_size, options_.image_size, rng)
        : center_crop(example.image, options_.image_size, options_.image_size);
  }
  return example;
}

DatasetReport ImageCaptionDataset::report() const {
  DatasetReport report = index_report_;
  report.skipped_unreadable_images = unreadable_.load();
  return report;
}

void verify_images(const ImageCaptionDataset& dataset) {
  log::Progress progress("verifying images", static_cast<int64_t>(dataset.size()));
  std::mt19937_64 rng(0);
  for (size_t i = 0; i < dataset.size(); ++i) {
    dataset.get(i, rng);
    progress.advance();
  }
  progress.finish();
}

void write_sample_grid(const ImageCaptionDataset& dataset, const std::string& path, int64_t count,
                       uint64_t seed, int64_t tile_size) {
  const auto order = ShardedSampler(static_cast<int64_t>(dataset.size()), {.seed = seed}).indices(0);
  std::vector<torch::Tensor> images;
  std::vector<std::string> captions;
  for (size_t i = 0; i < order.size() && static_cast<int64_t>(images.size()) < count; ++i) {
    std::mt19937_64 rng(mix_seed(seed, static_cast<uint64_t>(order[i])));
    if (auto example = dataset.get(static_cast<size_t>(order[i]), rng)) {
      images.push_back(example->image);
      captions.push_back(example->caption);
    }
  }
  if (images.empty()) throw Error(dataset.root() + ": no readable image for a sample grid");
  write_png(path, make_grid(images, captions, {.tile_size = tile_size}));
}

}  // namespace dalle::data
