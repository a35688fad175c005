#pragma once
// A group of processes that train one model together, on c10d, the engine PyTorch itself
// uses: a TCPStore for the rendezvous (rank 0 serves it, or a launcher's agent does), a
// PrefixStore per group, and ProcessGroupGloo for CPU tensors or ProcessGroupNCCL for GPUs.
// The collectives block until every rank has taken part, and throw Error after the group's
// timeout instead of hanging.
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dalle::distributed {

// gloo carries CPU tensors (and CUDA ones, through the host); NCCL carries CUDA tensors
// between GPUs, one GPU per rank.
enum class Backend { gloo, nccl };

// A network slower than the one at hand, for measurements: each collective completes no
// sooner than `latency + bytes / bandwidth` after it could start, where bytes are what one
// rank sends in a ring (2 (N-1)/N of an all-reduce's payload, (N-1)/N of an all-gather's or
// reduce-scatter's whole) and the collectives of a group queue on one link. The wait sleeps:
// no CPU is spent, so a 2-core box shows what a real network does to a step.
struct SimulatedLink {
  double gigabits_per_second = 0;  // 0: no simulated link
  double latency_ms = 0;
  bool enabled() const { return gigabits_per_second > 0; }
};
// "gbps,latency_ms" (for instance "10,0.5"), as the benchmarks and dalle-train take it; throws Error otherwise.
SimulatedLink parse_simulated_link(const std::string& text);

struct ProcessGroupOptions {
  std::string address = "127.0.0.1";  // the store's host; gloo binds to it too, never to every interface
  int64_t port = 29500;
  int64_t rank = 0;
  int64_t world_size = 1;
  bool serve_store = true;  // rank 0 serves the store, unless a launcher's agent already does
  // A socket rank 0's store listens on, bound and handed over by a launcher (dalle's
  // --nproc-per-node) so that no other process can take the port in between; -1: none.
  int listen_fd = -1;
  std::string prefix = "default";  // the group's keys in the store
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  Backend backend = Backend::gloo;
  int cuda_device = 0;  // NCCL: this rank's GPU
  SimulatedLink link = {};  // delays every collective of the group as that link would
  // A group of this process alone (world_size 1): its store lives in memory, no port is
  // opened and no rendezvous waited for. What a job of one shards over (Job::within_node).
  bool alone = false;
};

enum class ReduceOp { sum, average, max, min };

// A collective under way: wait() returns once it is done, or throws as the blocking call would.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual void wait() = 0;
};

class ProcessGroup {
 public:
  explicit ProcessGroup(const ProcessGroupOptions& options);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int64_t rank() const;
  int64_t size() const;
  // Where the tensors of this group's collectives live: the CPU for gloo, the rank's GPU for NCCL.
  torch::Device device() const;
  // In place, on every rank's `tensor` (on device(), contiguous).
  void all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::sum);
  // The same, started: `tensor` must stay alive and untouched until wait().
  std::unique_ptr<PendingCollective> start_all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::sum);
  // Every rank's `tensor`, in rank order, into `gathered` ([size * n] for n elements).
  void all_gather(const torch::Tensor& tensor, torch::Tensor& gathered);
  // The same, started: `tensor` and `gathered` must stay alive and untouched until wait().
  std::unique_ptr<PendingCollective> start_all_gather(const torch::Tensor& tensor, torch::Tensor& gathered);
  // `input` ([size * n], contiguous) reduced over the ranks with `op`; rank r receives part r
  // into `output` ([n]). The input is the collective's: gloo all-reduces it in place (its own
  // reduce-scatter is an all-reduce of a copy), so its values after are undefined.
  void reduce_scatter(torch::Tensor& input, torch::Tensor& output, ReduceOp op = ReduceOp::sum);
  // The same, started: `input` and `output` must stay alive and untouched until wait().
  std::unique_ptr<PendingCollective> start_reduce_scatter(torch::Tensor& input, torch::Tensor& output,
                                                          ReduceOp op = ReduceOp::sum);
  void barrier();

  // What this rank has sent in the collectives so far, as a ring sends it (the bytes a
  // simulated link carries), and the link from now on (a benchmark sets it once it has
  // measured the step without it).
  double bytes_sent() const;
  void set_simulated_link(const SimulatedLink& link);

  struct Impl;  // c10d's objects, seen only by src/distributed/process_group.cpp

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dalle::distributed
