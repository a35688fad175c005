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

}  // namespace dalle
