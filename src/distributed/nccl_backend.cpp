#include "distributed/nccl_backend.h"

#include "dalle/error.h"

#ifdef DALLE_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace dalle::distributed::detail {

#ifdef DALLE_WITH_NCCL

bool nccl_built() { return true; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, int device_index) {
  // NCCL binds a communicator to the device current when it is made.
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

#else

bool nccl_built() { return false; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                    std::chrono::milliseconds, int) {
  throw Error("this build of dalle has no NCCL (it was configured without CUDA or without the torch wheel's "
              "nvidia/nccl headers); train on the CPU, or rebuild where they are");
}

#endif

}  // namespace dalle::distributed::detail
