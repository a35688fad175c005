#pragma once
// Small files that claim to be large: what a careless or hostile user hands the tools.
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <string>

namespace dalle::testing {

inline void append_big_endian(std::string& bytes, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) bytes += static_cast<char>((value >> shift) & 0xFF);
}

inline void append_png_chunk(std::string& png, const std::string& type, const std::string& data) {
  append_big_endian(png, static_cast<uint32_t>(data.size()));
  const std::string body = type + data;
  png += body;
  append_big_endian(png, static_cast<uint32_t>(
                             crc32(0, reinterpret_cast<const Bytef*>(body.data()), static_cast<uInt>(body.size()))));
}

// A well-formed PNG header claiming width x height pixels (bit_depth 8 or 16; colour_type 2
// RGB, 6 RGBA) over a few hundred bytes of zlib data: decoded, it would take gigabytes.
inline std::string png_claiming(uint32_t width, uint32_t height, int bit_depth = 8, int colour_type = 2) {
  std::string png = "\x89PNG\r\n\x1a\n";
  std::string header;
  append_big_endian(header, width);
  append_big_endian(header, height);
  header += static_cast<char>(bit_depth);
  header += static_cast<char>(colour_type);
  header += std::string(3, '\0');  // deflate, adaptive filtering, no interlace
  append_png_chunk(png, "IHDR", header);
  const std::string rows(1 << 16, '\0');  // the first rows, all zero
  uLongf packed_size = compressBound(rows.size());
  std::string packed(packed_size, '\0');
  compress2(reinterpret_cast<Bytef*>(packed.data()), &packed_size, reinterpret_cast<const Bytef*>(rows.data()),
            rows.size(), 9);
  packed.resize(packed_size);
  append_png_chunk(png, "IDAT", packed);
  append_png_chunk(png, "IEND", "");
  return png;
}

// A JPEG's start and baseline frame header claiming width x height pixels, and nothing else.
inline std::string jpeg_claiming(uint32_t width, uint32_t height) {
  std::string jpeg = "\xFF\xD8\xFF\xE0";
  jpeg += std::string("\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00", 16);
  jpeg += "\xFF\xC0";
  jpeg += std::string("\x00\x11\x08", 3);
  jpeg += static_cast<char>(height >> 8);
  jpeg += static_cast<char>(height & 0xFF);
  jpeg += static_cast<char>(width >> 8);
  jpeg += static_cast<char>(width & 0xFF);
  jpeg += std::string("\x03\x01\x22\x00\x02\x11\x01\x03\x11\x01", 10);
  return jpeg;
}

// The id of a process that has ended: what a killed writer's temporary names carry.
inline pid_t ended_process_id() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

}  // namespace dalle::testing
