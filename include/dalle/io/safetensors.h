#pragma once
// The safetensors format: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the tensor bytes. Reading validates the header
// completely before touching any tensor bytes, so a truncated, corrupt or hostile file is
// refused with a clear error.
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "dalle/error.h"

namespace dalle::io {

using TensorMap = std::map<std::string, torch::Tensor>;
using Metadata = std::map<std::string, std::string>;

class FormatError : public Error {
 public:
  using Error::Error;
};

struct Safetensors {
  TensorMap tensors;
  Metadata metadata;  // the header's "__metadata__": string keys to string values
};

// Headers larger than this are refused: real checkpoints stay far below it, and a hostile
// length cannot make the reader allocate gigabytes.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

// The tensors are views of the file, mapped copy-on-write: a model that loads them copies
// each weight once, into itself, without a second copy of the checkpoint in memory; writing
// into a tensor never reaches the file. (A tensor whose offset its type cannot be read from,
// possible in files written elsewhere, is copied.)
Safetensors read_safetensors(const std::string& path);
// Drops the file pages under `tensor`, a view of a file read_safetensors mapped, from the
// process's memory: a tensor read once (a checkpoint's slice or a model's weight, copied where
// it belongs) then stops counting until the file is closed, and is read from the file again if
// it is read. Only for a tensor never written (a private mapping's written pages would be
// lost); nothing for a tensor over no mapped file (a copied one, a parsed file's, any other).
void release_pages(const torch::Tensor& tensor);
// Parses an in-memory file; `name` appears in error messages.
Safetensors parse_safetensors(std::string_view bytes, const std::string& name = "<memory>");

// Tensors are written contiguous, from CPU, in name order; the header is padded to 8 bytes.
std::string serialize_safetensors(const TensorMap& tensors, const Metadata& metadata = {});
// Atomic: a temporary file renamed into place.
void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const Metadata& metadata = {});

// "F32", "BF16", ... for a torch dtype; throws for dtypes the format cannot hold.
std::string safetensors_dtype_name(torch::ScalarType type);

}  // namespace dalle::io
