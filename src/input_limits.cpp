#include "dalle/input_limits.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "dalle/error.h"

namespace dalle {
namespace {

constexpr int64_t kDefaultMaxImagePixels = int64_t{1} << 25;
constexpr int64_t kDefaultMaxTextBytes = 1024;

// The variable's value, or `fallback` when it is unset; anything but a positive integer is
// refused rather than silently lifting or lowering the limit.
int64_t limit_from_environment(const char* variable, int64_t fallback) {
  const char* text = std::getenv(variable);
  if (text == nullptr || *text == '\0') return fallback;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || value <= 0) {
    throw Error(std::string(variable) + "=" + excerpt(text, 40) + ": expected a positive integer");
  }
  return value;
}

// The number of bytes of the UTF-8 character `lead` starts, 0 when it cannot start one.
size_t sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

bool is_continuation(unsigned char byte) { return (byte & 0xC0) == 0x80; }

}  // namespace

int64_t max_image_pixels() { return limit_from_environment("DALLE_MAX_IMAGE_PIXELS", kDefaultMaxImagePixels); }

int64_t max_text_bytes() { return limit_from_environment("DALLE_MAX_TEXT_BYTES", kDefaultMaxTextBytes); }

bool is_valid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    const size_t length = sequence_length(lead);
    if (length == 0 || i + length > text.size()) return false;
    for (size_t k = 1; k < length; ++k) {
      if (!is_continuation(static_cast<unsigned char>(text[i + k]))) return false;
    }
    if (length > 2) {
      // Overlong forms, UTF-16 surrogates and code points past U+10FFFF.
      const auto second = static_cast<unsigned char>(text[i + 1]);
      if ((lead == 0xE0 && second < 0xA0) || (lead == 0xED && second > 0x9F) || (lead == 0xF0 && second < 0x90) ||
          (lead == 0xF4 && second > 0x8F)) {
        return false;
      }
    }
    i += length;
  }
  return true;
}

std::string_view utf8_prefix(std::string_view text, size_t bytes) {
  if (text.size() <= bytes) return text;
  size_t end = bytes;
  while (end > 0 && is_continuation(static_cast<unsigned char>(text[end]))) --end;
  return text.substr(0, end);
}

std::string excerpt(std::string_view text, size_t bytes) {
  std::string quoted = "'";
  for (unsigned char c : utf8_prefix(text, bytes)) {
    if (c < 0x20 || c == 0x7F) quoted += '?';  // no terminal control sequences from a file
    else quoted += static_cast<char>(c);
  }
  quoted += "'";
  if (text.size() > bytes) quoted += "... (" + std::to_string(text.size()) + " bytes)";
  return quoted;
}

int64_t max_caption_line_bytes() { return 16384 * max_text_bytes(); }

void check_prompt(std::string_view prompt, const std::string& where) {
  const auto limit = static_cast<size_t>(max_text_bytes());
  if (prompt.size() > limit) {
    throw Error(where + ": the prompt is " + std::to_string(prompt.size()) + " bytes long, over the limit of " +
                std::to_string(limit) + " (DALLE_MAX_TEXT_BYTES)");
  }
  if (!is_valid_utf8(prompt)) throw Error(where + ": the prompt is not valid UTF-8");
  if (prompt.find_first_not_of(" \t\r\n") == std::string_view::npos) throw Error(where + ": the prompt is blank");
  for (size_t i = 0; i < prompt.size(); ++i) {
    const auto byte = static_cast<unsigned char>(prompt[i]);
    const bool c1 = byte == 0xC2 && i + 1 < prompt.size() && static_cast<unsigned char>(prompt[i + 1]) <= 0x9F;
    if ((byte < 0x20 && byte != '\t') || byte == 0x7F || c1) {
      char code[8];
      std::snprintf(code, sizeof code, "U+%04X", c1 ? static_cast<unsigned char>(prompt[i + 1]) : byte);
      throw Error(where + ": the prompt holds a control character (" + code + " at byte " + std::to_string(i + 1) +
                  "); a prompt is printable text on one line");
    }
  }
}

LineRead read_bounded_line(std::istream& in, size_t limit, std::string& line) {
  line.clear();
  int c = EOF;
  while ((c = in.get()) != EOF && c != '\n') {
    line += static_cast<char>(c);
    if (line.size() > limit) return LineRead::too_long;
  }
  return c == EOF && line.empty() ? LineRead::end : LineRead::line;
}

bool read_line_within(std::istream& in, size_t limit, std::string& line, const std::string& where, int64_t number,
                      const std::string& what) {
  const auto read = read_bounded_line(in, limit, line);
  if (read == LineRead::too_long) {
    throw Error(where + ":" + std::to_string(number) + ": a line of over " + std::to_string(limit) + " bytes; " + what);
  }
  return read == LineRead::line;
}

}  // namespace dalle
