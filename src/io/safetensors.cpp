#include "dalle/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dalle/input_limits.h"
#include "dalle/io/atomic_file.h"
#include "dalle/io/safetensors_writer.h"

namespace dalle::io {
namespace {

using json = nlohmann::json;

struct DtypeInfo {
  const char* name;
  torch::ScalarType type;
  size_t bytes;
};

constexpr DtypeInfo kDtypes[] = {
    {"F64", torch::kFloat64, 8},       {"F32", torch::kFloat32, 4},
    {"F16", torch::kFloat16, 2},       {"BF16", torch::kBFloat16, 2},
    {"F8_E4M3", torch::kFloat8_e4m3fn, 1}, {"F8_E5M2", torch::kFloat8_e5m2, 1},
    {"I64", torch::kInt64, 8},         {"I32", torch::kInt32, 4},
    {"I16", torch::kInt16, 2},         {"I8", torch::kInt8, 1},
    {"U8", torch::kUInt8, 1},          {"BOOL", torch::kBool, 1},
};

const DtypeInfo* find_dtype(std::string_view name) {
  for (const auto& info : kDtypes) {
    if (name == info.name) return &info;
  }
  return nullptr;
}

[[noreturn]] void refuse(const std::string& name, const std::string& why) {
  throw FormatError(name + ": not a valid safetensors file: " + why);
}

// nlohmann's parser recurses per nesting level; bound it before parsing hostile input.
void check_nesting(std::string_view header, const std::string& name) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : header) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > 8) refuse(name, "the header nests deeper than a safetensors header can");
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
}

uint64_t checked_product(const std::vector<int64_t>& shape, uint64_t element_bytes,
                         const std::string& name, const std::string& tensor) {
  // Every dimension counts, zeros aside: torch refuses a shape whose element count
  // overflows even when another dimension is 0.
  uint64_t nonzero = element_bytes;
  bool empty = false;
  for (int64_t dim : shape) {
    if (dim < 0) refuse(name, "tensor " + excerpt(tensor, 200) + " has a negative dimension");
    if (dim == 0) {
      empty = true;
      continue;
    }
    if (nonzero > static_cast<uint64_t>(INT64_MAX) / static_cast<uint64_t>(dim)) {
      refuse(name, "tensor " + excerpt(tensor, 200) + " has a shape too large to address");
    }
    nonzero *= static_cast<uint64_t>(dim);
  }
  return empty ? 0 : nonzero;
}

struct Entry {
  std::string name;
  const DtypeInfo* dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

std::vector<int64_t> read_shape(const json& value, const std::string& name, const std::string& tensor) {
  if (!value.is_array()) refuse(name, "tensor " + excerpt(tensor, 200) + ": 'shape' must be a list of integers");
  std::vector<int64_t> shape;
  for (const auto& dim : value) {
    if (!dim.is_number_integer()) refuse(name, "tensor " + excerpt(tensor, 200) + ": 'shape' must be a list of integers");
    shape.push_back(dim.get<int64_t>());
  }
  return shape;
}

Entry read_entry(const std::string& tensor, const json& value, const std::string& name,
                 uint64_t data_bytes) {
  if (!value.is_object()) refuse(name, "tensor " + excerpt(tensor, 200) + " is not described by an object");
  for (const auto& [key, unused] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      refuse(name, "tensor " + excerpt(tensor, 200) + " has an unknown field " + excerpt(key));
    }
  }
  if (!value.contains("dtype") || !value["dtype"].is_string()) {
    refuse(name, "tensor " + excerpt(tensor, 200) + " has no dtype");
  }
  const auto dtype_name = value["dtype"].get<std::string>();
  const DtypeInfo* dtype = find_dtype(dtype_name);
  if (!dtype) refuse(name, "tensor " + excerpt(tensor, 200) + " has an unsupported dtype " + excerpt(dtype_name));
  if (!value.contains("shape")) refuse(name, "tensor " + excerpt(tensor, 200) + " has no shape");
  auto shape = read_shape(value["shape"], name, tensor);
  const json& offsets = value.contains("data_offsets") ? value["data_offsets"] : json();
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    refuse(name, "tensor " + excerpt(tensor, 200) + ": 'data_offsets' must be two non-negative integers");
  }
  const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
  if (begin > end || end > data_bytes) {
    refuse(name, "tensor " + excerpt(tensor, 200) + " has byte range [" + std::to_string(begin) + ", " +
                     std::to_string(end) + ") outside the " + std::to_string(data_bytes) +
                     " data bytes (truncated file?)");
  }
  const uint64_t expected = checked_product(shape, dtype->bytes, name, tensor);
  if (end - begin != expected) {
    refuse(name, "tensor " + excerpt(tensor, 200) + " holds " + std::to_string(end - begin) +
                     " bytes but its dtype and shape need " + std::to_string(expected));
  }
  return {tensor, dtype, std::move(shape), begin, end};
}

void check_layout(std::vector<Entry>& entries, uint64_t data_bytes, const std::string& name) {
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  uint64_t covered = 0;
  for (const auto& entry : entries) {
    if (entry.begin < covered) refuse(name, "tensor " + excerpt(entry.name, 200) + " overlaps another tensor");
    if (entry.begin > covered) refuse(name, "bytes before tensor " + excerpt(entry.name, 200) + " belong to no tensor");
    covered = entry.end;
  }
  if (covered != data_bytes) {
    refuse(name, std::to_string(data_bytes - covered) + " trailing bytes belong to no tensor");
  }
}

Metadata read_metadata(const json& value, const std::string& name) {
  if (!value.is_object()) refuse(name, "'__metadata__' must map strings to strings");
  Metadata metadata;
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) refuse(name, "'__metadata__' value of " + excerpt(key) + " is not a string");
    metadata[key] = item.get<std::string>();
  }
  return metadata;
}

}  // namespace

std::string safetensors_dtype_name(torch::ScalarType type) {
  for (const auto& info : kDtypes) {
    if (info.type == type) return info.name;
  }
  throw FormatError(std::string("safetensors cannot hold tensors of dtype ") + c10::toString(type));
}

namespace {

// Builds the tensor of `entry` from its bytes at `bytes`.
using TensorMaker = std::function<torch::Tensor(const Entry& entry, const char* bytes)>;

Safetensors parse(std::string_view bytes, const std::string& name, const TensorMaker& make_tensor) {
  if (bytes.size() < 8) refuse(name, "shorter than the 8-byte header length (truncated file?)");
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);  // little-endian, as on every supported host
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    refuse(name, "header length " + std::to_string(header_bytes) + " exceeds the limit of " +
                     std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  if (header_bytes > bytes.size() - 8) {
    refuse(name, "header length " + std::to_string(header_bytes) + " runs past the end of the " +
                     std::to_string(bytes.size()) + "-byte file (truncated file?)");
  }
  const std::string_view header_text = bytes.substr(8, header_bytes);
  check_nesting(header_text, name);
  json header = json::parse(header_text.begin(), header_text.end(), nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) refuse(name, "the header is not valid JSON");
  if (!header.is_object()) refuse(name, "the header is not a JSON object");

  const std::string_view data = bytes.substr(8 + header_bytes);
  Safetensors result;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") result.metadata = read_metadata(value, name);
    else entries.push_back(read_entry(key, value, name, data.size()));
  }
  check_layout(entries, data.size(), name);
  for (const auto& entry : entries) {
    try {
      result.tensors.emplace(entry.name, make_tensor(entry, data.data() + entry.begin));
    } catch (const c10::Error& error) {
      refuse(name, "tensor " + excerpt(entry.name, 200) + ": " + error.what_without_backtrace());
    }
  }
  return result;
}

// A copy of the tensor's bytes, in memory of its own.
torch::Tensor copied(const Entry& entry, const char* bytes) {
  auto tensor = torch::empty(entry.shape, torch::TensorOptions().dtype(entry.dtype->type));
  std::memcpy(tensor.data_ptr(), bytes, entry.end - entry.begin);
  return tensor;
}

// The address ranges of the files mapped now (first byte -> size): what tells release_pages a
// tensor over a file's pages from one in memory of its own, whose pages it must never drop.
class MappedRanges {
 public:
  static MappedRanges& instance() {
    static MappedRanges ranges;
    return ranges;
  }
  void add(uintptr_t begin, size_t size) {
    const std::lock_guard lock(mutex_);
    ranges_[begin] = size;
  }
  void remove(uintptr_t begin) {
    const std::lock_guard lock(mutex_);
    ranges_.erase(begin);
  }
  bool holds(uintptr_t begin, uintptr_t end) const {
    const std::lock_guard lock(mutex_);
    auto after = ranges_.upper_bound(begin);
    if (after == ranges_.begin()) return false;
    const auto& [first, size] = *std::prev(after);
    return end <= first + size;
  }

 private:
  mutable std::mutex mutex_;
  std::map<uintptr_t, size_t> ranges_;
};

// A file mapped copy-on-write, unmapped when the last tensor over it is gone.
class Mapping {
 public:
  Mapping(void* address, size_t size) : address_(address), size_(size) {
    MappedRanges::instance().add(reinterpret_cast<uintptr_t>(address_), size_);
  }
  ~Mapping() {
    MappedRanges::instance().remove(reinterpret_cast<uintptr_t>(address_));
    ::munmap(address_, size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

 private:
  void* address_;
  size_t size_;
};

}  // namespace

Safetensors parse_safetensors(std::string_view bytes, const std::string& name) { return parse(bytes, name, copied); }

Safetensors read_safetensors(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw Error(path + ": cannot open: " + std::strerror(errno));
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  const auto size = static_cast<size_t>(info.st_size);
  if (size == 0) {
    ::close(fd);
    return parse_safetensors({}, path);
  }
  // Private and writable: a tensor written in place gets its own pages, the file is never touched.
  void* address = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (address == MAP_FAILED) throw Error(path + ": cannot map: " + std::strerror(errno));
  const auto mapping = std::make_shared<Mapping>(address, size);
  // The tensors are views of the file's pages, which the kernel reads on first touch and may
  // drop again: loading a model copies each weight once, into the model, and never holds a
  // second copy of the checkpoint in memory of its own. A tensor at an offset its type cannot
  // be read from (possible in files written elsewhere) is copied instead.
  const std::string_view bytes(static_cast<const char*>(address), size);
  return parse(bytes, path, [&mapping](const Entry& entry, const char* bytes) {
    if (reinterpret_cast<uintptr_t>(bytes) % entry.dtype->bytes != 0) return copied(entry, bytes);
    return torch::from_blob(const_cast<char*>(bytes), entry.shape, [mapping](void*) {},
                            torch::TensorOptions().dtype(entry.dtype->type));
  });
}

void release_pages(const torch::Tensor& tensor) {
  if (!tensor.defined() || tensor.nbytes() == 0) return;
  const auto begin = reinterpret_cast<uintptr_t>(tensor.data_ptr()), end = begin + tensor.nbytes();
  if (!MappedRanges::instance().holds(begin, end)) return;
  // Whole pages only: a page shared with a neighbouring tensor stays.
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

namespace {

// Streams the file, one tensor at a time, so that a large checkpoint is never copied whole
// into memory (nor, from a GPU, whole onto the host).
void write_safetensors_to(std::ostream& out, const TensorMap& tensors, const Metadata& metadata) {
  SafetensorsWriter writer(out, specs_of(tensors), metadata);
  for (const auto& [name, tensor] : tensors) writer.write(name, tensor);
}

}  // namespace

std::string serialize_safetensors(const TensorMap& tensors, const Metadata& metadata) {
  std::ostringstream out;
  write_safetensors_to(out, tensors, metadata);
  return out.str();
}

void write_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata) {
  write_file_atomic(path, [&](std::ostream& out) { write_safetensors_to(out, tensors, metadata); });
}

}  // namespace dalle::io
