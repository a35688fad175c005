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
#include <zlib.h>

#include "dalle/input_limits.h"
#include "dalle/io/atomic_file.h"

namespace dalle::data {
namespace F = torch::nn::functional;

namespace {

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
  const double scale = rgb.depth() == CV_16U ? 1.0 / 65535.0 : rgb.depth() == CV_8U ? 1.0 / 255.0 : 1.0;
  cv::Mat floats;
  rgb.convertTo(floats, CV_32FC3, scale);
  auto hwc = torch::from_blob(floats.data, {floats.rows, floats.cols, 3}, torch::kFloat32);
  return hwc.permute({2, 0, 1}).clamp(0.0, 1.0).contiguous();
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

struct PixelSize {
  int64_t width = 0, height = 0;
};

uint32_t big_endian(std::string_view bytes, size_t at, size_t count) {
  uint32_t value = 0;
  for (size_t i = 0; i < count; ++i) value = (value << 8) | static_cast<unsigned char>(bytes[at + i]);
  return value;
}

uint32_t little_endian(std::string_view bytes, size_t at, size_t count) {
  uint32_t value = 0;
  for (size_t i = count; i-- > 0;) value = (value << 8) | static_cast<unsigned char>(bytes[at + i]);
  return value;
}

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
  cv::Mat alpha, floats;
  cv::extractChannel(decoded, alpha, 3);
  const double scale = alpha.depth() == CV_16U ? 1.0 / 65535.0 : alpha.depth() == CV_8U ? 1.0 / 255.0 : 1.0;
  alpha.convertTo(floats, CV_32F, scale);
  return torch::from_blob(floats.data, {1, floats.rows, floats.cols}, torch::kFloat32).clamp(0.0, 1.0).clone();
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

namespace {

constexpr std::string_view kPngSignature = "\x89PNG\r\n\x1a\n";
constexpr size_t kPngHeaderEnd = 8 + 4 + 4 + 13 + 4;  // signature, then IHDR: length, type, 13 bytes, CRC

void append_big_endian(std::string& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((value >> shift) & 0xff));
}

uint32_t read_big_endian(std::string_view bytes, size_t at) {
  uint32_t value = 0;
  for (size_t i = 0; i < 4; ++i) value = (value << 8) | static_cast<unsigned char>(bytes[at + i]);
  return value;
}

std::string png_chunk(std::string_view type, std::string_view data) {
  std::string chunk;
  append_big_endian(chunk, static_cast<uint32_t>(data.size()));
  chunk.append(type).append(data);
  // The CRC covers the type and the data, not the length.
  const auto* covered = reinterpret_cast<const Bytef*>(chunk.data() + 4);
  append_big_endian(chunk, static_cast<uint32_t>(crc32(0, covered, static_cast<uInt>(chunk.size() - 4))));
  return chunk;
}

void check_png_keyword(const std::string& keyword) {
  const bool printable = std::all_of(keyword.begin(), keyword.end(), [](char c) {
    const auto byte = static_cast<unsigned char>(c);
    return (byte >= 32 && byte <= 126) || byte >= 161;
  });
  if (keyword.empty() || keyword.size() > 79 || !printable) {
    throw ImageError("a PNG text keyword has 1 to 79 printable Latin-1 characters: \"" + keyword + "\"");
  }
}

// The text of a tEXt or iTXt chunk's data when its keyword is `keyword`.
std::optional<std::string> text_under(std::string_view type, std::string_view data, const std::string& keyword) {
  const auto end_of_keyword = data.find('\0');
  if (end_of_keyword == std::string_view::npos || data.substr(0, end_of_keyword) != keyword) return std::nullopt;
  auto rest = data.substr(end_of_keyword + 1);
  if (type == "tEXt") return std::string(rest);
  // iTXt: compression flag and method, then language tag and translated keyword, each ended by 0.
  if (rest.size() < 2 || rest[0] != 0) return std::nullopt;  // compressed text is not ours
  rest.remove_prefix(2);
  for (int field = 0; field < 2; ++field) {
    const auto end = rest.find('\0');
    if (end == std::string_view::npos) return std::nullopt;
    rest.remove_prefix(end + 1);
  }
  return std::string(rest);
}

}  // namespace

std::string png_with_text(std::string_view png, const std::string& keyword, std::string_view text) {
  check_png_keyword(keyword);
  if (png.size() < kPngHeaderEnd || png.substr(0, 8) != kPngSignature || png.substr(12, 4) != "IHDR") {
    throw ImageError("not a PNG with its header first: cannot add a text chunk");
  }
  std::string data = keyword;
  data.append(std::string_view("\0\0\0\0\0", 5));  // end of keyword, not compressed, method, no language, no translation
  data.append(text);
  std::string out(png.substr(0, kPngHeaderEnd));
  out += png_chunk("iTXt", data);
  out.append(png.substr(kPngHeaderEnd));
  return out;
}

std::optional<std::string> png_text(std::string_view png, const std::string& keyword) {
  if (png.size() < 8 || png.substr(0, 8) != kPngSignature) throw ImageError("not a PNG (no PNG signature)");
  for (size_t at = 8; at < png.size();) {
    if (png.size() - at < 12) throw ImageError("a PNG chunk overruns the file at byte " + std::to_string(at));
    const size_t length = read_big_endian(png, at);
    if (length > png.size() - at - 12) throw ImageError("a PNG chunk overruns the file at byte " + std::to_string(at));
    const auto type = png.substr(at + 4, 4);
    const auto data = png.substr(at + 8, length);
    if (type == "tEXt" || type == "iTXt") {
      if (auto text = text_under(type, data, keyword)) return text;
    }
    if (type == "IEND") break;
    at += 12 + length;
  }
  return std::nullopt;
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
