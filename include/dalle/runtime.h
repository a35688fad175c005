#pragma once
#include <cstdint>
#include <string>
#include <string_view>

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

// Sets torch's intra-op threads: `threads` when positive; else one per core idle when it is
// called (the 1-minute load average and the processes running now, whichever is busier), at
// least 1 and at most torch's own default. Threads that outnumber the idle cores spin in
// OpenMP barriers against the other work and can run ten or twenty times slower.
// OMP_NUM_THREADS, when set, is taken as the default. Returns the count set.
int64_t set_torch_threads(int64_t threads);

// A field of this process's /proc/self/status in MiB: "VmRSS" (resident now), "VmHWM" (its
// peak); -1 where there is none (not Linux).
double process_memory_mib(const std::string& field);

// A 64-bit FNV-1a hash of `bytes`.
uint64_t fingerprint_of(std::string_view bytes);
// A hash of this build of the library (the bytes of its shared object): the ranks of a job
// compare theirs, so that none runs other code.
uint64_t build_fingerprint();

}  // namespace dalle
