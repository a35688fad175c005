#include "dalle/io/safetensors_writer.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace dalle::io {

namespace {

uint64_t bytes_of(const TensorSpec& spec) {
  uint64_t values = 1;
  for (const auto size : spec.shape) values *= static_cast<uint64_t>(size);
  return values * c10::elementSize(spec.dtype);
}

std::string shape_text(const std::vector<int64_t>& shape) { return c10::str(c10::IntArrayRef(shape)); }

}  // namespace

SafetensorsWriter::SafetensorsWriter(std::ostream& out, std::vector<TensorSpec> tensors, const Metadata& metadata)
    : out_(out), tensors_(std::move(tensors)) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& spec : tensors_) {
    if (spec.name == "__metadata__") throw FormatError("'__metadata__' cannot name a tensor");
    if (header.contains(spec.name)) throw FormatError("tensor '" + spec.name + "' is declared twice");
    const uint64_t bytes = bytes_of(spec);
    header[spec.name] = {{"dtype", safetensors_dtype_name(spec.dtype)},
                         {"shape", spec.shape},
                         {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  const uint64_t header_bytes = header_text.size();
  out_.write(reinterpret_cast<const char*>(&header_bytes), 8);
  out_.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
}

void SafetensorsWriter::write(const std::string& name, const torch::Tensor& tensor) {
  if (written_ == tensors_.size() || name != tensors_[written_].name) {
    throw Error("safetensors writer: got tensor '" + name + "' where " +
                (written_ == tensors_.size() ? "every declared tensor was written" : "'" + next() + "' comes next"));
  }
  const auto& spec = tensors_[written_];
  if (tensor.scalar_type() != spec.dtype || !tensor.sizes().equals(spec.shape)) {
    throw Error("safetensors writer: tensor '" + name + "' is " + c10::toString(tensor.scalar_type()) + " " +
                c10::str(tensor.sizes()) + ", declared " + c10::toString(spec.dtype) + " " + shape_text(spec.shape));
  }
  const auto cpu = tensor.detach().to(torch::kCPU).contiguous();
  out_.write(static_cast<const char*>(cpu.data_ptr()), static_cast<std::streamsize>(cpu.nbytes()));
  ++written_;
}

void SafetensorsWriter::finish() const {
  if (written_ < tensors_.size()) {
    throw Error("safetensors writer: " + std::to_string(tensors_.size() - written_) + " declared tensors unwritten, '" +
                next() + "' first");
  }
}

const std::string& SafetensorsWriter::next() const {
  static const std::string none;
  return written_ < tensors_.size() ? tensors_[written_].name : none;
}

std::vector<TensorSpec> specs_of(const TensorMap& tensors) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, tensor] : tensors) specs.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  return specs;
}

}  // namespace dalle::io
