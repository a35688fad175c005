#pragma once
// A safetensors file written one tensor at a time, in an order declared before the first: the
// header (every name, dtype, shape and byte range) is written first, so a model too large to
// hold whole is written as it is read, one part in memory at a time. The byte ranges follow
// the declared order, which need not be the names' (the format allows any).
#include <torch/types.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "dalle/io/safetensors.h"

namespace dalle::io {

struct TensorSpec {
  std::string name;
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
};

class SafetensorsWriter {
 public:
  // Writes the header of `tensors` (in their order) and `metadata` to `out`.
  SafetensorsWriter(std::ostream& out, std::vector<TensorSpec> tensors, const Metadata& metadata = {});
  // The next declared tensor's values (from any device, any layout); another name, dtype or
  // shape than declared is refused.
  void write(const std::string& name, const torch::Tensor& tensor);
  // Refuses a file whose declared tensors were not all written.
  void finish() const;
  // The name write() expects next ("" once all are written).
  const std::string& next() const;

 private:
  std::ostream& out_;
  std::vector<TensorSpec> tensors_;
  size_t written_ = 0;
};

// The specs of `tensors` in name order, as write_safetensors lays them out.
std::vector<TensorSpec> specs_of(const TensorMap& tensors);

}  // namespace dalle::io
