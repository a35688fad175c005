#include "dalle/data/degradation.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>

#include "dalle/error.h"

namespace dalle::data {
namespace F = torch::nn::functional;

namespace {

const std::vector<std::string> kInterpolations{"area", "bilinear", "bicubic", "nearest"};

// Uniform in [0, 1) from the top 53 bits: the std distributions differ across standard
// libraries, and a seed must give the same degradation everywhere.
double unit(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }
double uniform(const UniformRange& range, std::mt19937_64& rng) {
  return range.min + (range.max - range.min) * unit(rng);
}
bool chance(double probability, std::mt19937_64& rng) { return unit(rng) < probability; }

void check_range(const UniformRange& range, const std::string& key, double low, double high) {
  if (range.min > range.max) {
    throw ConfigError("degradation." + key + ": min (" + std::to_string(range.min) + ") is above max (" +
                      std::to_string(range.max) + ")");
  }
  if (range.min < low || range.max > high) {
    throw ConfigError("degradation." + key + " must lie within [" + std::to_string(low) + ", " +
                      std::to_string(high) + "]");
  }
}

int cv_interpolation(const std::string& name) {
  if (name == "area") return cv::INTER_AREA;
  if (name == "bilinear") return cv::INTER_LINEAR;
  if (name == "bicubic") return cv::INTER_CUBIC;
  if (name == "nearest") return cv::INTER_NEAREST;
  throw Error("degradation: unknown interpolation '" + name + "'");
}

// [C, H, W] float tensor <-> H x W x C float Mat (the channel order does not matter to
// blur, resize and noise; JPEG converts to BGR itself).
cv::Mat to_float_mat(const torch::Tensor& image) {
  auto hwc = image.detach().to(torch::kCPU, torch::kFloat32).permute({1, 2, 0}).contiguous();
  cv::Mat wrapped(static_cast<int>(hwc.size(0)), static_cast<int>(hwc.size(1)),
                  CV_32FC(static_cast<int>(hwc.size(2))), hwc.data_ptr());
  return wrapped.clone();
}

torch::Tensor from_float_mat(const cv::Mat& mat) {
  cv::Mat contiguous = mat.isContinuous() ? mat : mat.clone();
  return torch::from_blob(contiguous.data, {contiguous.rows, contiguous.cols, contiguous.channels()}, torch::kFloat32)
      .permute({2, 0, 1})
      .clone();
}

torch::Tensor jpeg(const torch::Tensor& image, int64_t quality) {
  if (image.size(0) != 3) throw Error("degradation: JPEG compression needs 3-channel images");
  auto bytes = image.mul(255.0).round().clamp(0.0, 255.0).to(torch::kUInt8).permute({1, 2, 0}).contiguous();
  cv::Mat rgb(static_cast<int>(bytes.size(0)), static_cast<int>(bytes.size(1)), CV_8UC3, bytes.data_ptr());
  cv::Mat bgr;
  cv::cvtColor(rgb, bgr, cv::COLOR_RGB2BGR);
  std::vector<uchar> encoded;
  if (!cv::imencode(".jpg", bgr, encoded, {cv::IMWRITE_JPEG_QUALITY, static_cast<int>(quality)})) {
    throw Error("degradation: JPEG encoding failed");
  }
  cv::Mat decoded = cv::imdecode(encoded, cv::IMREAD_COLOR);
  cv::cvtColor(decoded, rgb, cv::COLOR_BGR2RGB);
  cv::Mat floats;
  rgb.convertTo(floats, CV_32FC3, 1.0 / 255.0);
  return from_float_mat(floats);
}

}  // namespace

void DegradationConfig::visit(ConfigVisitor& v) {
  v.field("blur_probability", blur_probability, "chance that an image is blurred (Real-ESRGAN: 1)",
          {.min = 0.0, .max = 1.0});
  v.section("blur_sigma", "Gaussian blur sigma in high-resolution pixels (Real-ESRGAN: 0.2-3)", blur_sigma);
  v.field("interpolations", interpolations,
          "interpolations the downscaling picks from uniformly (Real-ESRGAN: area, bilinear, bicubic)",
          {.choices = kInterpolations});
  v.field("noise_probability", noise_probability,
          "chance that Gaussian noise is added (Real-ESRGAN always adds noise, Gaussian with chance 0.5, "
          "else Poisson, which is not implemented here)",
          {.min = 0.0, .max = 1.0});
  v.section("noise_sigma", "noise standard deviation in 8-bit levels, x / 255 (Real-ESRGAN: 1-30)", noise_sigma);
  v.field("gray_noise_probability", gray_noise_probability,
          "chance that the noise is the same on every channel (Real-ESRGAN: 0.4)", {.min = 0.0, .max = 1.0});
  v.field("jpeg_probability", jpeg_probability, "chance that the image is JPEG-compressed (Real-ESRGAN: 1)",
          {.min = 0.0, .max = 1.0});
  v.section("jpeg_quality", "JPEG quality, drawn then rounded (Real-ESRGAN: 30-95)", jpeg_quality);
}

void DegradationConfig::validate() const {
  check_range(blur_sigma, "blur_sigma", 0.0, 50.0);
  check_range(noise_sigma, "noise_sigma", 0.0, 255.0);
  check_range(jpeg_quality, "jpeg_quality", 1.0, 100.0);
  if (interpolations.empty()) throw ConfigError("degradation.interpolations: name at least one interpolation");
  for (const auto& name : interpolations) {
    if (std::find(kInterpolations.begin(), kInterpolations.end(), name) == kInterpolations.end()) {
      throw ConfigError("degradation.interpolations: unknown interpolation '" + name + "'");
    }
  }
}

DegradationDraw draw_degradation(const DegradationConfig& config, std::mt19937_64& rng) {
  // Every draw is made whether or not its stage runs, so that one setting does not shift
  // the random choices of the others.
  if (config.interpolations.empty()) throw ConfigError("degradation.interpolations: name at least one interpolation");
  DegradationDraw draw;
  const bool blur = chance(config.blur_probability, rng);
  const double sigma = uniform(config.blur_sigma, rng);
  draw.blur_sigma = blur ? sigma : 0.0;
  draw.interpolation = config.interpolations[rng() % config.interpolations.size()];
  const bool noise = chance(config.noise_probability, rng);
  const double noise_sigma = uniform(config.noise_sigma, rng);
  draw.noise_sigma = noise ? noise_sigma : 0.0;
  draw.gray_noise = chance(config.gray_noise_probability, rng);
  draw.noise_seed = rng();
  const bool compress = chance(config.jpeg_probability, rng);
  const auto quality = static_cast<int64_t>(std::lround(uniform(config.jpeg_quality, rng)));
  draw.jpeg_quality = compress ? std::clamp<int64_t>(quality, 1, 100) : 0;
  return draw;
}

torch::Tensor degrade(const torch::Tensor& image, int64_t scale, const DegradationDraw& draw) {
  if (image.dim() != 3 || image.size(0) < 1 || image.size(0) > 4) {
    throw Error("degradation: expected a [channels, H, W] image");
  }
  if (scale < 1 || image.size(1) % scale != 0 || image.size(2) % scale != 0) {
    throw Error("degradation: image sides " + std::to_string(image.size(1)) + "x" + std::to_string(image.size(2)) +
                " must be multiples of the scale " + std::to_string(scale));
  }
  cv::Mat mat = to_float_mat(image);
  if (draw.blur_sigma > 0) {
    // Kernel side 2 * ceil(3 sigma) + 1, reflected borders (OpenCV's default, BORDER_REFLECT_101).
    const int radius = static_cast<int>(std::ceil(3.0 * draw.blur_sigma));
    cv::GaussianBlur(mat, mat, cv::Size(2 * radius + 1, 2 * radius + 1), draw.blur_sigma, draw.blur_sigma);
  }
  if (scale > 1) {
    cv::Mat small;
    cv::resize(mat, small, cv::Size(mat.cols / static_cast<int>(scale), mat.rows / static_cast<int>(scale)), 0, 0,
               cv_interpolation(draw.interpolation));
    mat = small;
  }
  auto low = from_float_mat(mat);
  if (draw.noise_sigma > 0) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(draw.noise_seed);
    const auto shape = draw.gray_noise ? std::vector<int64_t>{1, low.size(1), low.size(2)} : low.sizes().vec();
    low = low + torch::randn(shape, generator, torch::TensorOptions(torch::kFloat32)) * (draw.noise_sigma / 255.0);
  }
  low = low.clamp(0.0, 1.0);
  if (draw.jpeg_quality > 0) low = jpeg(low, draw.jpeg_quality);
  // 8-bit levels, as an image read from disk would be.
  return low.mul(255.0).round().div(255.0).clamp(0.0, 1.0);
}

torch::Tensor degrade(const torch::Tensor& image, int64_t scale, const DegradationConfig& config,
                      std::mt19937_64& rng) {
  return degrade(image, scale, draw_degradation(config, rng));
}

torch::Tensor bicubic_upscale(const torch::Tensor& images, int64_t scale) {
  if (images.dim() != 4) throw Error("bicubic_upscale: expected [batch, channels, h, w] images");
  return F::interpolate(images, F::InterpolateFuncOptions()
                                    .scale_factor(std::vector<double>{double(scale), double(scale)})
                                    .mode(torch::kBicubic)
                                    .align_corners(false))
      .clamp(0.0, 1.0);
}

}  // namespace dalle::data
