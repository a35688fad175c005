#include "dalle/runtime.h"

#include <torch/torch.h>

#include <sstream>

namespace dalle {

#ifdef DALLE_WITH_CUDA
int cuda_runtime_version_from_device_code();  // src/cuda/cuda_runtime_info.cu
#endif

std::string version() { return DALLE_VERSION; }

bool built_with_cuda() {
#ifdef DALLE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_runtime_version() {
#ifdef DALLE_WITH_CUDA
  return cuda_runtime_version_from_device_code();
#else
  return 0;
#endif
}

std::string runtime_summary() {
  std::ostringstream out;
  out << "dalle " << version() << ", torch " << TORCH_VERSION << ", CUDA sources "
      << (built_with_cuda() ? "on" : "off") << ", CUDA devices "
      << (torch::cuda::is_available() ? torch::cuda::device_count() : 0)
      << ", CPU threads " << at::get_num_threads();
  return out.str();
}

}  // namespace dalle
