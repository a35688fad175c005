#pragma once
// Real-ESRGAN's classical ("first-order") degradation, which makes a low-resolution
// training input from a high-resolution image on the fly: Gaussian blur with a random
// sigma, downscaling by the model's scale with a random interpolation, additive Gaussian
// noise with a random sigma, JPEG compression at a random quality, and 8-bit rounding
// (Real-ESRGAN's order: blur, resize, noise, JPEG). Every range is a config key; every
// random choice comes from the caller's generator, so a seed fixes the result.
#include <torch/types.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "dalle/config.h"

namespace dalle::data {

// A closed interval a value is drawn from uniformly.
struct UniformRange {
  double min = 0;
  double max = 0;

  void visit(ConfigVisitor& v) {
    v.field("min", min, "lower end");
    v.field("max", max, "upper end (equal to min: always that value)");
  }
};

struct DegradationConfig {
  double blur_probability = 1.0;
  UniformRange blur_sigma{0.2, 3.0};
  std::vector<std::string> interpolations{"area", "bilinear", "bicubic"};
  double noise_probability = 0.5;
  UniformRange noise_sigma{1.0, 30.0};
  double gray_noise_probability = 0.4;
  double jpeg_probability = 1.0;
  UniformRange jpeg_quality{30.0, 95.0};

  void visit(ConfigVisitor& v);
  // Throws, naming the key, when a range is empty or out of bounds.
  void validate() const;
};

// One draw of the pipeline's random choices; 0 sigmas / quality mean the stage is skipped.
struct DegradationDraw {
  double blur_sigma = 0;       // in high-resolution pixels
  std::string interpolation;   // area, bilinear, bicubic or nearest
  double noise_sigma = 0;      // in 8-bit levels (x / 255)
  bool gray_noise = false;     // one noise image for all channels
  int64_t jpeg_quality = 0;    // 1..100
  uint64_t noise_seed = 0;
};

// Draws the random choices of one degradation from `rng`.
DegradationDraw draw_degradation(const DegradationConfig& config, std::mt19937_64& rng);

// [C, H, W] image in [0, 1] -> [C, H / scale, W / scale] in [0, 1], on 8-bit levels. H and
// W must be multiples of `scale`.
torch::Tensor degrade(const torch::Tensor& image, int64_t scale, const DegradationDraw& draw);
torch::Tensor degrade(const torch::Tensor& image, int64_t scale, const DegradationConfig& config,
                      std::mt19937_64& rng);

// Upscales [B, C, h, w] images by `scale` with bicubic interpolation (clamped to [0, 1]):
// the baseline a super-resolution network has to beat.
torch::Tensor bicubic_upscale(const torch::Tensor& images, int64_t scale);

}  // namespace dalle::data
