#pragma once
#include <string>

namespace dalle {

// The library's version, "major.minor.patch".
std::string version();
// True when the library's own CUDA sources were compiled in (DALLE_CUDA).
bool built_with_cuda();
// The CUDA runtime version the library sees (e.g. 13000), 0 when built without CUDA or
// when no driver is present.
int cuda_runtime_version();
// One line describing the build and the devices torch can use: for logs and --version.
std::string runtime_summary();

}  // namespace dalle
