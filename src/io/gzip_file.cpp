#include "gzip_file.h"

#include <zlib.h>

#include "dalle/error.h"

namespace dalle::io {

std::vector<uint8_t> read_maybe_gzipped(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (!file) throw Error(path + ": cannot open");
  std::vector<uint8_t> bytes;
  uint8_t chunk[1 << 16];
  int count;
  while ((count = gzread(file, chunk, sizeof chunk)) > 0) bytes.insert(bytes.end(), chunk, chunk + count);
  const bool failed = count < 0;
  gzclose(file);
  if (failed) throw Error(path + ": corrupt gzip data");
  return bytes;
}

}  // namespace dalle::io
