#include "dalle/data/image_grid.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <opencv2/imgproc.hpp>
#include <sstream>

#include "dalle/data/image.h"
#include "dalle/input_limits.h"
#include "data/opencv_image.h"

namespace dalle::data {
namespace F = torch::nn::functional;

namespace {

constexpr int kFont = cv::FONT_HERSHEY_SIMPLEX;
constexpr double kFontScale = 0.35;
constexpr int kLineHeight = 12;

// A label shows what a tile is, not the whole of a long caption: it is cut to a few lines,
// enough for a two-item caption and its CLIP score under a 128-pixel tile.
constexpr size_t kLabelBytes = 200;
constexpr size_t kLabelLines = 6;

std::vector<std::string> wrap_words(const std::string& text, int width) {
  std::vector<std::string> lines;
  std::istringstream words(std::string(utf8_prefix(text, kLabelBytes)));
  std::string line;
  for (std::string word; words >> word;) {
    const std::string candidate = line.empty() ? word : line + " " + word;
    int baseline = 0;
    if (!line.empty() && cv::getTextSize(candidate, kFont, kFontScale, 1, &baseline).width > width) {
      lines.push_back(line);
      line = word;
    } else {
      line = candidate;
    }
  }
  if (!line.empty()) lines.push_back(line);
  if (lines.size() > kLabelLines || text.size() > kLabelBytes) {
    lines.resize(std::min(lines.size(), kLabelLines));
    if (!lines.empty()) lines.back() += "...";
  }
  return lines;
}

}  // namespace

torch::Tensor make_grid(const std::vector<torch::Tensor>& images, const std::vector<std::string>& labels,
                        const GridOptions& options) {
  if (images.empty()) throw ImageError("make_grid: no images");
  if (!labels.empty() && labels.size() != images.size()) {
    throw ImageError("make_grid: " + std::to_string(labels.size()) + " labels for " +
                     std::to_string(images.size()) + " images");
  }
  for (const auto& image : images) require_image(image, "make_grid");
  const auto count = static_cast<int64_t>(images.size());
  const int64_t columns = options.columns > 0
      ? std::min(options.columns, count)
      : static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(count))));
  const int64_t rows = (count + columns - 1) / columns;
  const int64_t tile_h = options.tile_size > 0 ? options.tile_size : images[0].size(1);
  const int64_t tile_w = options.tile_size > 0 ? options.tile_size : images[0].size(2);
  const int64_t pad = options.padding;

  std::vector<std::vector<std::string>> wrapped;
  size_t label_lines = 0;
  for (const auto& label : labels) {
    wrapped.push_back(wrap_words(label, static_cast<int>(tile_w)));
    label_lines = std::max(label_lines, wrapped.back().size());
  }
  const int64_t label_h = static_cast<int64_t>(label_lines) * kLineHeight + (label_lines ? 4 : 0);
  const int64_t cell_h = tile_h + label_h + pad, cell_w = tile_w + pad;

  auto grid = torch::ones({3, rows * cell_h + pad, columns * cell_w + pad});
  for (int64_t i = 0; i < count; ++i) {
    auto tile = images[i].to(torch::kCPU, torch::kFloat32);
    if (tile.size(0) == 1) tile = tile.expand({3, tile.size(1), tile.size(2)});
    if (tile.size(1) != tile_h || tile.size(2) != tile_w) {
      tile = F::interpolate(tile.unsqueeze(0), F::InterpolateFuncOptions()
                                                   .size(std::vector<int64_t>{tile_h, tile_w})
                                                   .mode(torch::kNearest)).squeeze(0);
    }
    const int64_t top = pad + (i / columns) * cell_h, left = pad + (i % columns) * cell_w;
    grid.slice(1, top, top + tile_h).slice(2, left, left + tile_w).copy_(tile.clamp(0.0, 1.0));
  }
  if (label_lines == 0) return grid;

  cv::Mat canvas = to_mat(grid);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t top = pad + (i / columns) * cell_h + tile_h, left = pad + (i % columns) * cell_w;
    for (size_t line = 0; line < wrapped[i].size(); ++line) {
      cv::Point origin(static_cast<int>(left), static_cast<int>(top + (line + 1) * kLineHeight));
      cv::putText(canvas, wrapped[i][line], origin, kFont, kFontScale, cv::Scalar(0, 0, 0), 1, cv::LINE_AA);
    }
  }
  return from_mat(canvas, "grid");
}

}  // namespace dalle::data
