#include "dalle/data/image.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>
#include <sstream>
#include <string_view>
#include <vector>

#include "dalle/input_limits.h"
#include "dalle/io/atomic_file.h"
#include "data/byte_order.h"
#include "data/opencv_image.h"

namespace dalle::data {
namespace F = torch::nn::functional;

namespace {

struct PixelSize {
  int64_t width = 0, height = 0;
};

// JPEG: the frame header (SOF0-SOF15 but DHT, JPG and DAC) follows the segments before it.
std::optional<PixelSize> jpeg_size(std::string_view bytes) {
  size_t at = 2;
  while (at + 4 <= bytes.size()) {
    if (static_cast<unsigned char>(bytes[at]) != 0xFF) return std::nullopt;
    const auto marker = static_cast<unsigned char>(bytes[at + 1]);
    if (marker == 0xFF) {  // fill byte
      ++at;
      continue;
    }
    if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7)) {  // no length field
      at += 2;
      continue;
    }
    const size_t length = big_endian(bytes, at + 2, 2);
    const bool frame = marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
    if (frame) {
      if (at + 9 > bytes.size()) return std::nullopt;
      return PixelSize{big_endian(bytes, at + 7, 2), big_endian(bytes, at + 5, 2)};
    }
    if (length < 2) return std::nullopt;
    at += 2 + length;
  }
  return std::nullopt;
}

// TIFF: ImageWidth (256) and ImageLength (257) in the first image file directory.
std::optional<PixelSize> tiff_size(std::string_view bytes) {
  const bool little = bytes[0] == 'I';
  const auto read = [&](size_t at, size_t count) {
    return little ? little_endian(bytes, at, count) : big_endian(bytes, at, count);
  };
  const size_t directory = read(4, 4);
  if (directory + 2 > bytes.size()) return std::nullopt;
  PixelSize size{-1, -1};
  for (size_t i = 0, entries = read(directory, 2); i < entries; ++i) {
    const size_t at = directory + 2 + 12 * i;
    if (at + 12 > bytes.size()) break;
    const uint32_t tag = read(at, 2), type = read(at + 2, 2);
    if (tag != 256 && tag != 257) continue;
    const int64_t value = type == 3 ? read(at + 8, 2) : read(at + 8, 4);  // SHORT or LONG
    (tag == 256 ? size.width : size.height) = value;
  }
  if (size.width < 0 || size.height < 0) return std::nullopt;
  return size;
}

// PNM (P1-P6): width and height are the first two numbers after the magic, comments aside.
std::optional<PixelSize> pnm_size(std::string_view bytes) {
  std::vector<int64_t> numbers;
  size_t at = 2;
  while (numbers.size() < 2 && at < bytes.size() && at < 4096) {
    const char c = bytes[at];
    if (c == '#') {
      while (at < bytes.size() && bytes[at] != '\n') ++at;
    } else if (c >= '0' && c <= '9') {
      int64_t value = 0;
      for (; at < bytes.size() && bytes[at] >= '0' && bytes[at] <= '9' && value < (int64_t{1} << 40); ++at) {
        value = value * 10 + (bytes[at] - '0');
      }
      numbers.push_back(value);
    } else {
      ++at;
    }
  }
  if (numbers.size() < 2) return std::nullopt;
  return PixelSize{numbers[0], numbers[1]};
}

// The size an image's header claims, for the formats whose header says it plainly (PNG,
// JPEG, BMP, WebP, TIFF, PNM); nullopt for others, which OpenCV bounds with its own limit.
std::optional<PixelSize> header_size(std::string_view bytes) {
  const auto starts_with = [&](std::string_view prefix, size_t at = 0) {
    return bytes.size() >= at + prefix.size() && bytes.substr(at, prefix.size()) == prefix;
  };
  if (starts_with("\x89PNG\r\n\x1a\n") && starts_with("IHDR", 12) && bytes.size() >= 24) {
    return PixelSize{big_endian(bytes, 16, 4), big_endian(bytes, 20, 4)};
  }
  if (starts_with("\xFF\xD8")) return jpeg_size(bytes);
  if (starts_with("BM") && bytes.size() >= 26) {
    if (little_endian(bytes, 14, 4) == 12) return PixelSize{little_endian(bytes, 18, 2), little_endian(bytes, 20, 2)};
    const auto height = static_cast<int32_t>(little_endian(bytes, 22, 4));  // negative: top-down rows
    return PixelSize{static_cast<int32_t>(little_endian(bytes, 18, 4)), std::abs(static_cast<int64_t>(height))};
  }
  if (starts_with("RIFF") && starts_with("WEBP", 8) && bytes.size() >= 30) {
    if (starts_with("VP8 ", 12)) {
      return PixelSize{little_endian(bytes, 26, 2) & 0x3FFF, little_endian(bytes, 28, 2) & 0x3FFF};
    }
    if (starts_with("VP8L", 12)) {
      const uint32_t bits = little_endian(bytes, 21, 4);
      return PixelSize{(bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1};
    }
    if (starts_with("VP8X", 12)) return PixelSize{little_endian(bytes, 24, 3) + 1, little_endian(bytes, 27, 3) + 1};
  }
  if ((starts_with(std::string_view("II*\0", 4)) || starts_with(std::string_view("MM\0*", 4))) && bytes.size() >= 8) {
    return tiff_size(bytes);
  }
  if (bytes.size() >= 3 && bytes[0] == 'P' && bytes[1] >= '1' && bytes[1] <= '6') return pnm_size(bytes);
  return std::nullopt;
}

// Refuses, before decoding, an image whose header claims more pixels than the limit: a
// small file can claim gigapixels (a decompression bomb).
void check_pixel_count(std::string_view bytes, const std::string& name) {
  const auto size = header_size(bytes);
  if (!size) return;
  const int64_t limit = max_image_pixels();
  if (size->width < 0 || size->height < 0 || (size->width > 0 && size->height > limit / size->width)) {
    throw ImageError(name + ": " + std::to_string(size->width) + "x" + std::to_string(size->height) +
                     " pixels, over the limit of " + std::to_string(limit) +
                     " (DALLE_MAX_IMAGE_PIXELS); not decoded");
  }
}

}  // namespace

std::optional<int64_t> header_pixels(std::string_view bytes) {
  const auto size = header_size(bytes);
  if (!size || size->width < 0 || size->height < 0) return std::nullopt;
  return size->width * size->height;
}

torch::Tensor decode_image(std::string_view bytes, const std::string& name) {
  if (bytes.empty()) throw ImageError(name + ": empty file");
  check_pixel_count(bytes, name);
  cv::Mat buffer(1, static_cast<int>(bytes.size()), CV_8U, const_cast<char*>(bytes.data()));
  cv::Mat decoded;
  try {
    decoded = cv::imdecode(buffer, cv::IMREAD_ANYDEPTH | cv::IMREAD_ANYCOLOR);
  } catch (const cv::Exception& error) {
    throw ImageError(name + ": cannot decode the image: " + error.msg);
  }
  if (decoded.empty()) throw ImageError(name + ": not a readable image (corrupt or unsupported format)");
  try {
    return from_mat(decoded, name);
  } catch (const cv::Exception& error) {
    throw ImageError(name + ": cannot convert the decoded image: " + error.msg);
  }
}

std::optional<torch::Tensor> decode_alpha(std::string_view bytes, const std::string& name) {
  if (bytes.empty()) throw ImageError(name + ": empty file");
  check_pixel_count(bytes, name);
  cv::Mat buffer(1, static_cast<int>(bytes.size()), CV_8U, const_cast<char*>(bytes.data()));
  cv::Mat decoded;
  try {
    decoded = cv::imdecode(buffer, cv::IMREAD_UNCHANGED);
  } catch (const cv::Exception& error) {
    throw ImageError(name + ": cannot decode the image: " + error.msg);
  }
  if (decoded.empty()) throw ImageError(name + ": not a readable image (corrupt or unsupported format)");
  if (decoded.channels() != 4) return std::nullopt;
  cv::Mat alpha;
  cv::extractChannel(decoded, alpha, 3);
  decoded.release();
  if (alpha.depth() != CV_8U && alpha.depth() != CV_16U && alpha.depth() != CV_32F) alpha.convertTo(alpha, CV_32F);
  // As from_mat: one float32 tensor, scaled as OpenCV's convertTo scales, clamped in place.
  const auto type = alpha.depth() == CV_16U ? torch::kUInt16 : alpha.depth() == CV_8U ? torch::kUInt8 : torch::kFloat32;
  const double scale = alpha.depth() == CV_16U ? 1.0 / 65535.0 : alpha.depth() == CV_8U ? 1.0 / 255.0 : 1.0;
  auto opacity = torch::empty({1, alpha.rows, alpha.cols}, torch::kFloat32);
  opacity.copy_(torch::from_blob(alpha.data, {1, alpha.rows, alpha.cols}, torch::TensorOptions().dtype(type)));
  if (scale != 1.0) opacity.mul_(static_cast<float>(scale));
  return opacity.clamp_(0.0, 1.0);
}

torch::Tensor read_image(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ImageError(path + ": cannot open");
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return decode_image(bytes.str(), path);
}

std::string encode_png(const torch::Tensor& image) {
  std::vector<uchar> png;
  if (!cv::imencode(".png", to_mat(image), png)) throw ImageError("cannot encode the image as PNG");
  return std::string(png.begin(), png.end());
}

void write_png(const std::string& path, const torch::Tensor& image) {
  io::write_file_atomic(path, encode_png(image));
}

torch::Tensor resize(const torch::Tensor& image, int64_t height, int64_t width) {
  require_image(image, "resize");
  if (height <= 0 || width <= 0) throw ImageError("resize: the size must be positive");
  const bool shrinking = height < image.size(1) || width < image.size(2);
  auto options = F::InterpolateFuncOptions()
                     .size(std::vector<int64_t>{height, width})
                     .mode(torch::kBilinear)
                     .align_corners(false)
                     .antialias(shrinking);
  return F::interpolate(image.unsqueeze(0), options).squeeze(0).clamp(0.0, 1.0);
}

torch::Tensor resize_shorter_side(const torch::Tensor& image, int64_t size) {
  require_image(image, "resize");
  const int64_t height = image.size(1), width = image.size(2);
  if (std::min(height, width) == size) return image;
  if (height <= width) {
    return resize(image, size, std::max<int64_t>(1, std::llround(double(width) * size / height)));
  }
  return resize(image, std::max<int64_t>(1, std::llround(double(height) * size / width)), size);
}

torch::Tensor center_crop(const torch::Tensor& image, int64_t height, int64_t width) {
  require_image(image, "center_crop");
  if (height > image.size(1) || width > image.size(2)) {
    throw ImageError("center_crop: the crop is larger than the image");
  }
  const int64_t top = (image.size(1) - height) / 2, left = (image.size(2) - width) / 2;
  return image.slice(1, top, top + height).slice(2, left, left + width);
}

torch::Tensor random_crop(const torch::Tensor& image, int64_t height, int64_t width,
                          std::mt19937_64& rng) {
  require_image(image, "random_crop");
  if (height > image.size(1) || width > image.size(2)) {
    throw ImageError("random_crop: the crop is larger than the image");
  }
  // Modulo rather than std::uniform_int_distribution: the latter differs across standard
  // libraries, and crops must be reproducible from a seed.
  const int64_t top = static_cast<int64_t>(rng() % static_cast<uint64_t>(image.size(1) - height + 1));
  const int64_t left = static_cast<int64_t>(rng() % static_cast<uint64_t>(image.size(2) - width + 1));
  return image.slice(1, top, top + height).slice(2, left, left + width);
}
}  // namespace dalle::data
