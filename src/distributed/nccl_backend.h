#pragma once
// c10d's ProcessGroupNCCL, made in a translation unit of its own: the only one that sees
// NCCL's header (the torch wheel's nvidia/nccl/include, whose macros shape the inline
// ProcessGroupNCCL::Options). Built where CUDA and that header are; private to the library.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>

namespace dalle::distributed::detail {

// Whether this build has NCCL.
bool nccl_built();
// A ProcessGroupNCCL on CUDA device `device_index` (made current first); throws Error in a
// build without NCCL.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, int device_index);

}  // namespace dalle::distributed::detail
