#include "unicode.h"

#include <wctype.h>

namespace dalle::text {

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

std::u32string decode_utf8(std::string_view text) {
  std::u32string out;
  for (size_t i = 0; i < text.size();) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const int extra = byte < 0x80 ? 0 : (byte >> 5) == 0x6 ? 1 : (byte >> 4) == 0xE ? 2 : (byte >> 3) == 0x1E ? 3 : -1;
    char32_t c = extra == 0 ? byte : extra == 1 ? byte & 0x1F : extra == 2 ? byte & 0x0F : byte & 0x07;
    bool valid = extra >= 0 && i + static_cast<size_t>(extra) < text.size();
    for (int k = 1; valid && k <= extra; ++k) {
      const auto next = static_cast<unsigned char>(text[i + static_cast<size_t>(k)]);
      valid = (next >> 6) == 0x2;
      c = (c << 6) | (next & 0x3F);
    }
    if (!valid) {
      out += U'\uFFFD';
      ++i;
      continue;
    }
    out += c;
    i += static_cast<size_t>(extra) + 1;
  }
  return out;
}

std::string encode_utf8(std::u32string_view text) {
  std::string out;
  for (const char32_t c : text) append_utf8(out, c);
  return out;
}

CharClasses::CharClasses() : locale_(newlocale(LC_CTYPE_MASK, "C.UTF-8", locale_t{})) {}

CharClasses::~CharClasses() {
  if (locale_) freelocale(locale_);
}

bool CharClasses::letter(char32_t c) const {
  if (c < 0x80) return (c | 0x20) >= U'a' && (c | 0x20) <= U'z';
  return locale_ && iswalpha_l(static_cast<wint_t>(c), locale_);
}

bool CharClasses::space(char32_t c) const {
  if (c == 0xA0 || c == 0x85 || c == 0x2007 || c == 0x202F || (c >= 0x1C && c <= 0x1F)) return true;
  return c < 0x80 ? (c == ' ' || (c >= 0x09 && c <= 0x0D))
                  : locale_ && iswspace_l(static_cast<wint_t>(c), locale_);
}

char32_t CharClasses::lower(char32_t c) const {
  if (c < 0x80) return c >= U'A' && c <= U'Z' ? c + 32 : c;
  return locale_ ? static_cast<char32_t>(towlower_l(static_cast<wint_t>(c), locale_)) : c;
}

std::u32string CharClasses::lower(std::u32string_view text) const {
  std::u32string out;
  for (size_t i = 0; i < text.size(); ++i) {
    const char32_t c = text[i];
    if (c == U'\u0130') {
      out += U"i\u0307";
    } else if (c == U'\u03A3') {
      const bool after_letter = i > 0 && letter(text[i - 1]);
      const bool before_letter = i + 1 < text.size() && letter(text[i + 1]);
      out += after_letter && !before_letter ? U'\u03C2' : U'\u03C3';
    } else {
      out += lower(c);
    }
  }
  return out;
}

const CharClasses& char_classes() {
  static const CharClasses classes;
  return classes;
}

}  // namespace dalle::text
