#pragma once
// Unsigned integers of 1-4 bytes as image headers and PNG chunks store them.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dalle::data {

inline uint32_t big_endian(std::string_view bytes, size_t at, size_t count) {
  uint32_t value = 0;
  for (size_t i = 0; i < count; ++i) value = (value << 8) | static_cast<unsigned char>(bytes[at + i]);
  return value;
}

inline uint32_t little_endian(std::string_view bytes, size_t at, size_t count) {
  uint32_t value = 0;
  for (size_t i = count; i-- > 0;) value = (value << 8) | static_cast<unsigned char>(bytes[at + i]);
  return value;
}

inline void append_big_endian(std::string& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((value >> shift) & 0xff));
}

}  // namespace dalle::data
