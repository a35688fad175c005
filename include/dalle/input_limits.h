#pragma once
// Bounds on what a user's files may make the library do, so that a hostile or careless
// file costs bounded memory and time: images above a pixel count are refused from their
// header, before they are decoded; captions are cut, and prompts refused, above a byte
// length. Real data stays far below the defaults; an environment variable changes each
// limit for every tool at once.
#include <cstddef>
#include <cstdint>
#include <istream>
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

// The longest line a captions file (TSV, JSON lines or plain) may hold: 16384 x
// max_text_bytes (16 MiB), far above any real line (whose over-long captions are cut, with
// a warning) yet a bound on a file without line ends.
int64_t max_caption_line_bytes();

// Throws Error("<where>: ...") unless `prompt` is valid UTF-8, not blank, within
// max_text_bytes and free of control characters (C0 but tab, DEL, C1): nothing a prompt
// carries into the prior, the sidecars or a terminal may steer them.
void check_prompt(std::string_view prompt, const std::string& where);

enum class LineRead { line, end, too_long };
// The next line of `in` into `line`, without its '\n', reading at most `limit` + 1 bytes: a
// longer line, or a stream without line ends such as /dev/zero, ends as too_long with nothing
// more read, so that no input costs unbounded memory or time. end: nothing was left.
LineRead read_bounded_line(std::istream& in, size_t limit, std::string& line);
// read_bounded_line, throwing Error("<where>:<number>: a line of over <limit> bytes; <what>")
// on a longer one.
bool read_line_within(std::istream& in, size_t limit, std::string& line, const std::string& where, int64_t number,
                      const std::string& what);

}  // namespace dalle
