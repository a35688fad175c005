#include "dalle/data/classifier_input.h"

#include <torch/torch.h>

#include <algorithm>

#include "dalle/data/image.h"

namespace dalle::data {

torch::Tensor classifier_input(const torch::Tensor& grey, double threshold) {
  TORCH_CHECK(grey.dim() == 2, "classifier_input: expected a [H, W] picture, got ", grey.sizes());
  auto picture = grey.to(torch::kFloat32).contiguous();
  const int64_t height = picture.size(0), width = picture.size(1);
  const float brightest = picture.numel() > 0 ? picture.max().item<float>() : 0.0f;
  if (brightest <= 0.0f) return torch::zeros({1, kClassifierInputSize, kClassifierInputSize});
  // Scaled to [0, 1] first: data::resize clamps to that range.
  picture = picture / brightest;
  const float* p = picture.data_ptr<float>();
  int64_t x0 = width, y0 = height, x1 = -1, y1 = -1;
  for (int64_t y = 0; y < height; ++y) {
    for (int64_t x = 0; x < width; ++x) {
      if (p[y * width + x] > threshold) {
        x0 = std::min(x0, x), x1 = std::max(x1, x);
        y0 = std::min(y0, y), y1 = std::max(y1, y);
      }
    }
  }
  const int64_t box_width = x1 - x0 + 1, box_height = y1 - y0 + 1, side = std::max(box_width, box_height);
  // The square about the box's centre; pixels outside the picture stay black.
  const int64_t left = x0 - (side - box_width) / 2, top = y0 - (side - box_height) / 2;
  auto square = torch::zeros({1, side, side});
  float* s = square.data_ptr<float>();
  for (int64_t y = std::max<int64_t>(0, top); y < std::min(height, top + side); ++y) {
    for (int64_t x = std::max<int64_t>(0, left); x < std::min(width, left + side); ++x) {
      s[(y - top) * side + (x - left)] = p[y * width + x];
    }
  }
  if (side != kClassifierInputSize) square = resize(square, kClassifierInputSize, kClassifierInputSize);
  return square / square.max().clamp_min(1e-6);
}

}  // namespace dalle::data
