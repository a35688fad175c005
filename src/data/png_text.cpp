#include "dalle/data/png_text.h"

#include <algorithm>
#include <zlib.h>

#include "dalle/data/image.h"
#include "data/byte_order.h"

namespace dalle::data {

namespace {

constexpr std::string_view kPngSignature = "\x89PNG\r\n\x1a\n";
constexpr size_t kPngHeaderEnd = 8 + 4 + 4 + 13 + 4;  // signature, then IHDR: length, type, 13 bytes, CRC

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
    const size_t length = big_endian(png, at, 4);
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

}  // namespace dalle::data
