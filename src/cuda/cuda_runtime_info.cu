#include <cuda_runtime_api.h>

namespace dalle {

// Kept free of torch headers so that nvcc compiles it in seconds.
int cuda_runtime_version_from_device_code() {
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) return 0;
  return version;
}

}  // namespace dalle
