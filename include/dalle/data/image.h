#pragma once
// Images as torch tensors: [3, H, W], float32, RGB, values in [0, 1]. OpenCV decodes and
// encodes; everything else is tensor arithmetic.
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "dalle/error.h"

namespace dalle::data {

class ImageError : public Error {
 public:
  using Error::Error;
};

// Reads PNG, JPEG, BMP, WebP, TIFF, PPM...; grey and 16-bit images become 8-bit-range RGB,
// alpha is dropped. An unreadable or corrupt file throws ImageError naming it.
torch::Tensor read_image(const std::string& path);
torch::Tensor decode_image(std::string_view bytes, const std::string& name);
// The alpha channel of an encoded image, [1, H, W] in [0, 1] (1: opaque); nothing when the
// image has none. Throws as decode_image does.
std::optional<torch::Tensor> decode_alpha(std::string_view bytes, const std::string& name);
// The pixels an encoded image's header declares (PNG, JPEG, BMP, WebP, TIFF, PNM), read
// without decoding it; nothing when the header is not one of these or cannot be read. A
// decode_image holds at most kDecodeBytesPerPixel bytes per pixel at once (8-bit RGB:
// the decode, its RGB copy and the float32 result); decode_alpha half that.
std::optional<int64_t> header_pixels(std::string_view bytes);
inline constexpr int64_t kDecodeBytesPerPixel = 18;

// Writes [3, H, W] or [1, H, W] values in [0, 1] (clamped) as 8-bit PNG, atomically.
void write_png(const std::string& path, const torch::Tensor& image);
std::string encode_png(const torch::Tensor& image);

// Area-averaging when shrinking, bilinear when enlarging.
torch::Tensor resize(const torch::Tensor& image, int64_t height, int64_t width);
// Scales so that the shorter side is `size`, keeping the aspect ratio.
torch::Tensor resize_shorter_side(const torch::Tensor& image, int64_t size);
torch::Tensor center_crop(const torch::Tensor& image, int64_t height, int64_t width);
torch::Tensor random_crop(const torch::Tensor& image, int64_t height, int64_t width,
                          std::mt19937_64& rng);

}  // namespace dalle::data
