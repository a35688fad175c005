#include "dalle/device.h"

#include <torch/cuda.h>

#include "dalle/error.h"

namespace dalle {

torch::Device resolve_device(const std::string& name, const std::string& what) {
  if (name == "cpu" || (name == "auto" && !torch::cuda::is_available())) return torch::kCPU;
  if (name != "auto" && name != "cuda") throw Error(what + ": unknown device '" + name + "' (auto, cpu or cuda)");
  if (!torch::cuda::is_available()) throw Error(what + ": device cuda was asked for, but torch sees no CUDA device");
  return torch::kCUDA;
}

torch::ScalarType float_type_named(const std::string& name) {
  if (name == "float32") return torch::kFloat32;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float16") return torch::kFloat16;
  throw Error("unknown floating-point type '" + name + "' (float32, bfloat16 or float16)");
}

}  // namespace dalle
