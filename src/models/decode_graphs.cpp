#include "dalle/models/decode_graphs.h"

#include <torch/torch.h>

#include <algorithm>
#include <optional>

#include "dalle/log.h"

#ifdef DALLE_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace dalle::models {

struct DecodeGraphs::Graphs {
#ifdef DALLE_WITH_CUDA
  // One pool for all: the graphs of a decode replay one after another, never at once.
  decltype(at::cuda::graph_pool_handle()) pool = at::cuda::graph_pool_handle();
  std::map<int64_t, std::unique_ptr<at::cuda::CUDAGraph>> by_key;
  // Every capture on one stream: the library handles and workspaces its first step set up
  // serve the later captures too.
  std::optional<c10::cuda::CUDAStream> side;
#endif
};

DecodeGraphs::DecodeGraphs(bool enabled) : enabled_(enabled) {}
DecodeGraphs::~DecodeGraphs() = default;

bool DecodeGraphs::captures_on(const torch::Device& device) const {
#ifdef DALLE_WITH_CUDA
  return enabled_ && !failed_ && device.is_cuda();
#else
  (void)device;
  return false;
#endif
}

void DecodeGraphs::expect(const std::string& signature) {
  if (signature == signature_) return;
  drop_graphs();
  signature_ = signature;
}

torch::Tensor DecodeGraphs::buffer(const std::string& name, at::IntArrayRef sizes,
                                   const torch::TensorOptions& options) {
  auto& kept = buffers_[name];
  if (kept.defined() && kept.sizes() == sizes && kept.dtype() == options.dtype() &&
      kept.device() == options.device()) {
    return kept;
  }
  drop_graphs();
  kept = torch::Tensor();  // the old memory goes back before the new is taken
  kept = torch::zeros(sizes, options);
  return kept;
}

TensorMaker DecodeGraphs::maker() {
  return [this](const std::string& name, at::IntArrayRef sizes, const torch::TensorOptions& options) {
    return buffer(name, sizes, options);
  };
}

int64_t DecodeGraphs::keys_for(int64_t needed, int64_t capacity, const torch::Device& device) const {
  if (!device.is_cuda()) return needed;
  return std::min(capacity, (needed + kBucket - 1) / kBucket * kBucket);
}

int64_t DecodeGraphs::graphs() const {
#ifdef DALLE_WITH_CUDA
  return graphs_ ? static_cast<int64_t>(graphs_->by_key.size()) : 0;
#else
  return 0;
#endif
}

void DecodeGraphs::drop_graphs() {
#ifdef DALLE_WITH_CUDA
  // Work queued by a replay may still read the graphs' pool.
  if (graphs_ && !graphs_->by_key.empty()) torch::cuda::synchronize();
#endif
  graphs_.reset();
}

void DecodeGraphs::clear() {
  drop_graphs();
  buffers_.clear();
  signature_.clear();
}

#ifdef DALLE_WITH_CUDA
namespace {

// Ends a capture that `step` broke off, so that the stream and the allocator work on.
void abandon_capture(at::cuda::CUDAGraph& graph, const c10::cuda::CUDAStream& stream) {
  try {
    graph.capture_end();
  } catch (const std::exception&) {
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream.stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream.stream(), &broken);
    if (broken) cudaGraphDestroy(broken);
  }
  (void)cudaGetLastError();
}

}  // namespace
#endif

void DecodeGraphs::run(int64_t key, const torch::Device& device, const std::function<void()>& step) {
  if (!captures_on(device)) {
    step();
    return;
  }
#ifdef DALLE_WITH_CUDA
  if (!graphs_) graphs_ = std::make_unique<Graphs>();
  if (const auto found = graphs_->by_key.find(key); found != graphs_->by_key.end()) {
    found->second->replay();
    ++replays_;
    return;
  }
  const c10::cuda::OptionalCUDAGuard on_device(device.has_index() ? std::optional<c10::Device>(device) : std::nullopt);
  const auto current = c10::cuda::getCurrentCUDAStream();
  if (!graphs_->side || graphs_->side->device() != current.device()) {
    graphs_->side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, current.device_index());
  }
  const auto side = *graphs_->side;
  at::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(side);
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    // This step's work, and the warm-up a capture needs (library handles, workspaces).
    step();
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    try {
      graph->capture_begin(graphs_->pool, cudaStreamCaptureModeThreadLocal);
      step();
      graph->capture_end();
      graphs_->by_key.emplace(key, std::move(graph));
    } catch (const std::exception& error) {
      abandon_capture(*graph, side);
      failed_ = true;
      log::warn("decoding: capturing a step as a CUDA graph failed, so steps run eagerly from now on (",
                error.what(), ")");
    }
  }
  at::cuda::CUDAEvent done;
  done.record(side);
  done.block(current);
#else
  (void)key;
  step();
#endif
}

}  // namespace dalle::models
