#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dalle::io {

// The bytes of a gzipped file, or of a plain one (gzread passes those through unchanged).
std::vector<uint8_t> read_maybe_gzipped(const std::string& path);

}  // namespace dalle::io
