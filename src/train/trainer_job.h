#pragma once
// How a trainer joins its job: the backend for its device, the job itself (joined before any
// model is built, so that ranks started with another config or build are refused at once)
// and the device of each rank. Private to the library.
#include <torch/cuda.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>

#include "dalle/config.h"
#include "dalle/distributed/job.h"
#include "dalle/distributed/launch.h"
#include "dalle/error.h"
#include "dalle/runtime.h"
#include "dalle/train/recipe.h"

namespace dalle::train::detail {

// distributed.backend for a job on `device`: auto is NCCL on GPUs and gloo on the CPU.
inline distributed::Backend job_backend(const std::string& backend, torch::Device device) {
  if (backend == "gloo") return distributed::Backend::gloo;
  if (backend == "nccl" && !device.is_cuda()) {
    throw Error("distributed.backend nccl carries CUDA tensors only, but run.device is " + device.str() +
                "; use gloo or auto");
  }
  return device.is_cuda() ? distributed::Backend::nccl : distributed::Backend::gloo;
}

// Joins the job the launcher started (a job of one without a launcher) before any model is
// built, so that ranks started with another config or build are refused at once.
template <class Config>
std::shared_ptr<distributed::Job> join_job(Config config, const distributed::LaunchEnvironment& place,
                                           torch::Device device) {
  const auto& d = config.distributed;
  distributed::JobOptions options{.timeout = std::chrono::milliseconds(std::llround(d.timeout_seconds * 1000)),
                                  .bucket_bytes = bucket_bytes(d),
                                  .backend = job_backend(d.backend, device),
                                  .cuda_device = device.is_cuda() ? device.index() : 0,
                                  .overlap = d.overlap};
  if (!d.simulated_link.empty()) options.link = distributed::parse_simulated_link(d.simulated_link);
  options.powersgd = powersgd_options(d, config.run);
  return std::make_shared<distributed::Job>(
      place, options,
      distributed::Fingerprint{.config = fingerprint_of(config_to_yaml(visit_of(config))),
                               .code = build_fingerprint()});
}

// `device` for the rank at `place`: a GPU job gives each rank of a machine its own GPU.
inline torch::Device rank_device(torch::Device device, const distributed::LaunchEnvironment& place) {
  if (!device.is_cuda() || place.world_size == 1) return device;
  const auto gpus = std::max<int64_t>(static_cast<int64_t>(torch::cuda::device_count()), 1);
  return {torch::kCUDA, static_cast<c10::DeviceIndex>(place.local_rank % gpus)};
}

}  // namespace dalle::train::detail
