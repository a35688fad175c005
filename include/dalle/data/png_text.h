#pragma once
// PNG text chunks, so that an image carries how it was made (dalle-generate and dalle-serve
// store the generation's JSON under "dalle").
#include <optional>
#include <string>
#include <string_view>

namespace dalle::data {

// `png` with an iTXt chunk (UTF-8 `text`, not compressed) under `keyword` (1-79 printable
// Latin-1 characters) right after the header, where readers look first.
std::string png_with_text(std::string_view png, const std::string& keyword, std::string_view text);
// The text of the first tEXt or uncompressed iTXt chunk of `png` under `keyword`; nothing when
// there is none. A file that is not a PNG, or whose chunks overrun it, throws ImageError.
std::optional<std::string> png_text(std::string_view png, const std::string& keyword);

}  // namespace dalle::data
