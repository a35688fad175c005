#include "dalle/runtime.h"

#include <dlfcn.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

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

namespace {

// Cores busy with other work: /proc/loadavg's 1-minute average, or its count of entities
// running now less this process, whichever is larger (the average lags a job just started).
int64_t busy_cores() {
  std::ifstream in("/proc/loadavg");
  double average = 0;
  std::string ignored, running_of_total;
  if (!(in >> average >> ignored >> ignored >> running_of_total)) return 0;
  const int64_t running = std::atoll(running_of_total.c_str()) - 1;
  return std::max<int64_t>(std::llround(average), running);
}

}  // namespace

int64_t set_torch_threads(int64_t threads) {
  // Torch's own default, read before this function first changes it.
  static const int64_t torch_default = torch::get_num_threads();
  if (threads <= 0) {
    const char* configured = std::getenv("OMP_NUM_THREADS");
    if (configured != nullptr && *configured != '\0') {
      threads = torch_default;
    } else {
      const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
      threads = std::clamp<int64_t>(cores - busy_cores(), 1, std::max<int64_t>(1, torch_default));
    }
  }
  torch::set_num_threads(static_cast<int>(threads));
  return threads;
}

double process_memory_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return -1;
}

uint64_t fingerprint_of(std::string_view bytes) {
  uint64_t hash = 14695981039346656037ull;
  for (const unsigned char c : bytes) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

uint64_t build_fingerprint() {
  Dl_info library{};
  if (::dladdr(reinterpret_cast<void*>(&build_fingerprint), &library) == 0 || library.dli_fname == nullptr) {
    return fingerprint_of(version());
  }
  std::ifstream in(library.dli_fname, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return fingerprint_of(bytes.empty() ? version() : bytes);
}

}  // namespace dalle
