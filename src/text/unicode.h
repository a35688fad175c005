#pragma once
// UTF-8 and the character classes the tokenizers need, as the C library's Unicode tables
// (C.UTF-8) define them.
#include <locale.h>

#include <string>
#include <string_view>

namespace dalle::text {

void append_utf8(std::string& out, char32_t c);
std::string encode_utf8(std::u32string_view text);
// Malformed bytes become U+FFFD, as Python's decode(errors="replace") would make them.
std::u32string decode_utf8(std::string_view text);

// Letters, numbers and white space as the C library's Unicode tables (C.UTF-8) class them;
// Python's regex module uses Unicode's own categories, which agree outside rare scripts.
class CharClasses {
 public:
  CharClasses();
  ~CharClasses();
  CharClasses(const CharClasses&) = delete;
  CharClasses& operator=(const CharClasses&) = delete;

  bool letter(char32_t c) const;
  bool number(char32_t c) const { return c >= U'0' && c <= U'9'; }
  // Python's str.isspace(), which str.split() and str.strip() use: also the no-break spaces
  // and the C1/separator controls.
  bool space(char32_t c) const;
  // The simple lower case of one character.
  char32_t lower(char32_t c) const;
  // Python's str.lower(): the simple mappings, İ to i + U+0307, and a capital sigma at the
  // end of a word to ς.
  std::u32string lower(std::u32string_view text) const;

 private:
  locale_t locale_;
};

const CharClasses& char_classes();

}  // namespace dalle::text
