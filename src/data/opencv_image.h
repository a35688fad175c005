#pragma once
// Image tensors to and from OpenCV's matrices, for the codec and the grid's labels.
#include <torch/types.h>

#include <opencv2/core.hpp>
#include <string>

namespace dalle::data {

// Throws ImageError unless `image` is [3 or 1, H, W]; `what` names the caller.
void require_image(const torch::Tensor& image, const char* what);
// A decoded matrix (grey, BGR or BGRA; 8-bit, 16-bit or float) as [3, H, W] RGB in [0, 1];
// `name` is the file named in errors.
torch::Tensor from_mat(const cv::Mat& input, const std::string& name);
// [3 or 1, H, W] in [0, 1] (clamped) as an 8-bit BGR matrix of its own.
cv::Mat to_mat(const torch::Tensor& image);

}  // namespace dalle::data
