#pragma once
#include <functional>
#include <ostream>
#include <string>
#include <string_view>

namespace dalle::io {

// Writes a file so that readers see either the old content or the complete new content:
// the bytes go to a temporary file in the same directory, are flushed to disk, and the
// temporary is renamed over `path`. On any failure the temporary is removed and `path` is
// untouched.
void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& writer);
void write_file_atomic(const std::string& path, std::string_view content);

// A unique sibling name for temporary output next to `path`.
std::string temporary_sibling(const std::string& path);

}  // namespace dalle::io
