#include "dalle/generate/output.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>

#include "dalle/data/image.h"
#include "dalle/data/image_grid.h"
#include "dalle/data/png_text.h"
#include "dalle/error.h"
#include "dalle/generate/pipeline.h"
#include "dalle/input_limits.h"
#include "dalle/io/atomic_file.h"
#include "dalle/io/stale_temporaries.h"

namespace dalle::generate {
namespace fs = std::filesystem;

namespace {

// What dalle-generate writes into its folder, and dalle-eval's report of it.
bool written_by_generate(const fs::path& entry) {
  static const std::regex own(R"(\d{4,}-\d{2,}\.(png|json)|grid\.png|eval\.json)");
  return std::regex_match(entry.filename().string(), own);
}

// "out/" and "out" are one folder, and its temporaries are siblings, never inside it.
std::string without_trailing_slash(const std::string& path) {
  auto normal = fs::path(path).lexically_normal();
  return (normal.has_filename() ? normal : normal.parent_path()).string();
}

}  // namespace

std::vector<std::string> read_prompts_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot read the prompts file");
  const auto limit = static_cast<size_t>(max_text_bytes());
  std::vector<std::string> prompts;
  std::string line;
  for (int64_t number = 1;; ++number) {
    const std::string where = path + ":" + std::to_string(number);
    const auto read = read_bounded_line(in, limit + 1, line);  // + 1: room for a '\r' before the '\n'
    if (read == LineRead::end) break;
    if (read == LineRead::too_long || (line.size() > limit && line.back() != '\r')) {
      throw Error(where + ": the prompt is over the limit of " + std::to_string(limit) +
                  " bytes (DALLE_MAX_TEXT_BYTES); reading stopped there");
    }
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    check_prompt(line, where);
    prompts.push_back(line);
  }
  return prompts;
}

OutputFolder::OutputFolder(const std::string& target) : target_(without_trailing_slash(target)) {
  if (fs::exists(target_)) {
    if (!fs::is_directory(target_)) throw Error(target_ + ": exists and is not a folder");
    for (const auto& entry : fs::directory_iterator(target_)) {
      if (!written_by_generate(entry.path())) {
        throw Error(target_ + ": not empty and not an earlier dalle-generate output (it holds " +
                    excerpt(entry.path().filename().string()) + "); choose another folder");
      }
    }
    if (::access(target_.c_str(), W_OK) != 0) {
      throw Error(target_ + ": cannot be replaced: " + std::strerror(errno));
    }
  }
  io::remove_stale_temporaries(target_);
  // Created now, so that a folder that cannot be written is refused before any work.
  staging_ = io::temporary_sibling(target_);
  try {
    const auto parent = fs::path(staging_).parent_path();
    if (!parent.empty()) fs::create_directories(parent);
    fs::create_directory(staging_);
  } catch (const fs::filesystem_error& error) {
    throw Error(target_ + ": cannot write the output folder: " + error.code().message());
  }
}

OutputFolder::~OutputFolder() {
  std::error_code ignored;
  if (!committed_) fs::remove_all(staging_, ignored);
}

void OutputFolder::commit() {
  std::optional<std::string> previous;
  if (fs::exists(target_)) {
    previous = io::temporary_sibling(target_);
    fs::rename(target_, *previous);
  }
  try {
    fs::rename(staging_, target_);
  } catch (...) {
    if (previous) fs::rename(*previous, target_);
    throw;
  }
  committed_ = true;
  if (previous) fs::remove_all(*previous);
}

// The sidecars and PNGs of Pipeline's images (declared in generate/pipeline.h).
namespace {

nlohmann::json settings(PipelineConfig config) {
  nlohmann::json json = nlohmann::json::object();
  for (const auto& [key, value] : flatten_config(visit_of(config))) json[key] = value;
  return json;
}

nlohmann::json sidecar(const nlohmann::json& settings, const GeneratedImage& image) {
  const auto codes = image.tokens.flatten().contiguous();
  return {
      {"prompt", image.prompt},
      {"prompt_index", image.prompt_index},
      {"rank", image.rank},
      {"candidate", image.candidate},
      {"seed", image.seed},
      {"sampling_stream", sampling_stream(image.prompt_index, image.candidate)},
      {"top_k", image.top_k},
      {"top_p", image.top_p},
      {"clip_score", image.clip_score ? nlohmann::json(*image.clip_score) : nlohmann::json(nullptr)},
      {"size", {image.image.size(1), image.image.size(2)}},
      {"pipeline", settings},
      {"image_tokens", std::vector<int64_t>(codes.data_ptr<int64_t>(), codes.data_ptr<int64_t>() + codes.numel())}};
}

}  // namespace

void write_generation(const std::string& directory, const PipelineConfig& config,
                      const std::vector<GeneratedImage>& images) {
  if (images.empty()) throw Error("pipeline: no images to write");
  fs::create_directories(directory);
  const auto pipeline_settings = settings(config);
  std::vector<torch::Tensor> tiles;
  std::vector<std::string> labels;
  for (const auto& image : images) {
    char stem[64];
    std::snprintf(stem, sizeof stem, "%04lld-%02lld", static_cast<long long>(image.prompt_index),
                  static_cast<long long>(image.rank));
    const auto metadata = sidecar(pipeline_settings, image).dump(2) + "\n";
    io::write_file_atomic((fs::path(directory) / (std::string(stem) + ".png")).string(),
                          data::png_with_text(data::encode_png(image.image), kPngTextKeyword, metadata));
    io::write_file_atomic((fs::path(directory) / (std::string(stem) + ".json")).string(), metadata);
    tiles.push_back(image.image);
    std::string label = image.prompt;
    if (image.clip_score) label += " (" + std::to_string(*image.clip_score).substr(0, 5) + ")";
    labels.push_back(std::move(label));
  }
  data::write_png((fs::path(directory) / "grid.png").string(),
                  data::make_grid(tiles, labels, {.columns = config.kept(), .tile_size = 128}));
}

std::string image_metadata(const PipelineConfig& config, const GeneratedImage& image) {
  return sidecar(settings(config), image).dump(2) + "\n";
}

std::string encode_generated_png(const PipelineConfig& config, const GeneratedImage& image) {
  return data::png_with_text(data::encode_png(image.image), kPngTextKeyword, image_metadata(config, image));
}

}  // namespace dalle::generate
