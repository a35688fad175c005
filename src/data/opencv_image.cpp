#include "data/opencv_image.h"

#include <torch/torch.h>

#include <opencv2/imgproc.hpp>
#include <sstream>

#include "dalle/data/image.h"

namespace dalle::data {

void require_image(const torch::Tensor& image, const char* what) {
  if (image.dim() != 3 || (image.size(0) != 3 && image.size(0) != 1)) {
    std::ostringstream shape;
    shape << image.sizes();
    throw ImageError(std::string(what) + ": expected an image tensor [3 or 1, H, W], got " + shape.str());
  }
}

torch::Tensor from_mat(const cv::Mat& input, const std::string& name) {
  // cvtColor takes 8-bit, 16-bit and float images only; other depths go through float.
  cv::Mat decoded = input;
  const int depth = input.depth();
  if (depth != CV_8U && depth != CV_16U && depth != CV_32F) input.convertTo(decoded, CV_32F);
  cv::Mat rgb;
  switch (decoded.channels()) {
    case 1: cv::cvtColor(decoded, rgb, cv::COLOR_GRAY2RGB); break;
    case 3: cv::cvtColor(decoded, rgb, cv::COLOR_BGR2RGB); break;
    case 4: cv::cvtColor(decoded, rgb, cv::COLOR_BGRA2RGB); break;
    default: throw ImageError(name + ": unsupported number of channels " + std::to_string(decoded.channels()));
  }
  // Straight from the decoded type into one float32 tensor, scaled and clamped in place: the
  // peak is the decode and its RGB copy plus the result (18 bytes a pixel for 8-bit RGB, where
  // a float32 Mat, its clamped copy and a contiguous one made it 42). The values are those of
  // OpenCV's convertTo with the same scale, bit for bit.
  const auto type = rgb.depth() == CV_16U ? torch::kUInt16 : rgb.depth() == CV_8U ? torch::kUInt8 : torch::kFloat32;
  const double scale = rgb.depth() == CV_16U ? 1.0 / 65535.0 : rgb.depth() == CV_8U ? 1.0 / 255.0 : 1.0;
  const auto hwc = torch::from_blob(rgb.data, {rgb.rows, rgb.cols, 3}, torch::TensorOptions().dtype(type));
  auto image = torch::empty({3, rgb.rows, rgb.cols}, torch::kFloat32);
  image.copy_(hwc.permute({2, 0, 1}));
  if (scale != 1.0) image.mul_(static_cast<float>(scale));
  return image.clamp_(0.0, 1.0);
}

cv::Mat to_mat(const torch::Tensor& image) {
  require_image(image, "writing an image");
  auto rgb = image.size(0) == 1 ? image.expand({3, image.size(1), image.size(2)}) : image;
  auto bytes = rgb.detach().to(torch::kCPU, torch::kFloat32).clamp(0.0, 1.0).mul(255.0).round()
                   .to(torch::kUInt8).permute({1, 2, 0}).contiguous();
  cv::Mat wrapped(static_cast<int>(bytes.size(0)), static_cast<int>(bytes.size(1)), CV_8UC3, bytes.data_ptr());
  cv::Mat bgr;
  cv::cvtColor(wrapped, bgr, cv::COLOR_RGB2BGR);  // copies out of the tensor's memory
  return bgr;
}

}  // namespace dalle::data
