#pragma once
// Bounds on what a user's files may make the library do, so that a hostile or careless
// file costs bounded memory and time: images above a pixel count are refused from their
// header, before they are decoded; captions are cut, and prompts refused, above a byte
// length. Real data stays far below the defaults; an environment variable changes each
// limit for every tool at once.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dalle {

// DALLE_MAX_IMAGE_PIXELS: width x height of the largest image decoded (default 2^25,
// 33554432: an 8K frame or a 6000x4000 photo, about 1.3 GB while it is decoded).
int64_t max_image_pixels();
// DALLE_MAX_TEXT_BYTES: the longest caption kept whole and the longest prompt accepted
// (default 1024 bytes; a prior reads at most a few hundred tokens of it).
int64_t max_text_bytes();

bool is_valid_utf8(std::string_view text);
// The longest prefix of at most `bytes` bytes that does not end inside a UTF-8 character.
std::string_view utf8_prefix(std::string_view text, size_t bytes);
// `text` fit for an error message or a log line: at most `bytes` bytes of it, quoted, with
// its full length when cut, so that unbounded input is never echoed whole.
std::string excerpt(std::string_view text, size_t bytes = 60);

// Throws Error("<where>: ...") unless `prompt` is valid UTF-8, not blank, and within
// max_text_bytes. `length`: the length of the line `prompt` was read from, when the reader
// stopped early.
void check_prompt(std::string_view prompt, const std::string& where, size_t length = 0);

}  // namespace dalle
