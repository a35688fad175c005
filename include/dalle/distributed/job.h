#pragma once
// The processes that train one model together, as this process sees them: where it stands
// (distributed/launch.h), the process group it joined, and what every rank must agree on beyond
// gradients: that they run the same config and the same build, whether to stop, and the
// metrics they report. A process no launcher started is a job of one, with no group.
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dalle/distributed/gradient_reducer.h"
#include "dalle/distributed/launch.h"
#include "dalle/distributed/powersgd.h"
#include "dalle/distributed/process_group.h"

namespace dalle::distributed {

struct JobOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // of the rendezvous and of every collective
  int64_t bucket_bytes = 25 << 20;                              // of the gradient all-reduces
  Backend backend = Backend::gloo;                              // NCCL for a job on GPUs
  int cuda_device = 0;                                          // NCCL: this rank's GPU
  std::optional<PowerSgdOptions> powersgd = std::nullopt;       // the gradients' reduction, else whole
  bool overlap = true;                                          // gradients averaged during backward
  // Delays the collectives between machines (on one machine, between all ranks) as this link would.
  SimulatedLink link = {};
};

// What the ranks of a job must share: hashes of their config and of their code.
struct Fingerprint {
  uint64_t config = 0;
  uint64_t code = 0;
};

class Job {
 public:
  // Joins the job `place` describes: the process group, then a check that every rank has
  // rank 0's fingerprint (throws Error naming the ranks that differ, on every rank).
  Job(const LaunchEnvironment& place, const JobOptions& options, const Fingerprint& fingerprint);
  ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  const LaunchEnvironment& place() const { return place_; }
  int64_t rank() const { return place_.rank; }
  int64_t size() const { return place_.world_size; }
  // Rank 0, the one that writes the run's files.
  bool is_main() const { return place_.rank == 0; }

  // Whether any rank says `yes` (a stop request).
  bool any(bool yes);
  // Throws Error unless every rank has the same `value`; `what` names it in the message.
  void check_same(int64_t value, const std::string& what);
  // The mean over the ranks of each of `values`, in place.
  void average(std::vector<double>& values);
  void barrier();

  // How the update step averages gradients here: a LocalReducer for a job of one, else a
  // data-parallel reducer over the group (PowerSGD's, when the options ask for it).
  std::shared_ptr<GradientReducer> reducer() const { return reducer_; }
  // The group, or null for a job of one.
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  // The ranks of this machine (a group of its own, on one machine too; for a job of one, a
  // group of this process alone), and this rank's peers on the other machines, those of the
  // same local rank (null on one machine). Made at the first call, which every rank must make.
  std::shared_ptr<ProcessGroup> within_node();
  std::shared_ptr<ProcessGroup> across_nodes();

 private:
  std::vector<int64_t> gather(int64_t value);
  std::shared_ptr<ProcessGroup> subgroup(const std::string& name, int64_t rank, int64_t size,
                                         const SimulatedLink& link);

  LaunchEnvironment place_;
  JobOptions options_;
  std::shared_ptr<ProcessGroup> group_, within_node_, across_nodes_;
  std::shared_ptr<GradientReducer> reducer_;
};

}  // namespace dalle::distributed
