#include "dalle/io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dalle/error.h"

namespace dalle::io {
namespace fs = std::filesystem;

std::string temporary_sibling(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

namespace {

// Best effort: a failed fsync only weakens durability across a power cut, never correctness.
void sync_to_disk(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& writer) {
  const std::string temporary = temporary_sibling(path);
  try {
    {
      std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
      if (!out) {
        throw Error("cannot create '" + temporary + "': " + std::strerror(errno));
      }
      writer(out);
      out.flush();
      if (!out) throw Error("cannot write '" + temporary + "' (disk full?)");
    }
    sync_to_disk(temporary);
    fs::rename(temporary, path);
    // The rename itself must reach the disk, or a crash could bring the old file back.
    const auto parent = fs::path(path).parent_path();
    sync_to_disk(parent.empty() ? std::string(".") : parent.string());
  } catch (...) {
    std::error_code ignored;
    fs::remove(temporary, ignored);
    throw;
  }
}

void write_file_atomic(const std::string& path, std::string_view content) {
  write_file_atomic(path, [content](std::ostream& out) {
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
  });
}

}  // namespace dalle::io
