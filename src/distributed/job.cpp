#include "dalle/distributed/job.h"

#include <torch/torch.h>

#include <exception>

#include "dalle/distributed/data_parallel.h"
#include "dalle/error.h"
#include "dalle/log.h"

namespace dalle::distributed {

namespace {

// The ranks whose value differs from rank 0's, as "1, 3".
std::string ranks_differing(const std::vector<int64_t>& values) {
  std::string ranks;
  for (size_t r = 1; r < values.size(); ++r) {
    if (values[r] != values[0]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  return ranks;
}

}  // namespace

Job::Job(const LaunchEnvironment& place, const JobOptions& options, const Fingerprint& fingerprint)
    : place_(place), options_(options) {
  if (place_.world_size == 1) {
    reducer_ = std::make_shared<LocalReducer>();
    return;
  }
  // torchrun prefixes a restarted job's keys, so that a restart never reads its
  // predecessor's rendezvous.
  group_ = std::make_shared<ProcessGroup>(ProcessGroupOptions{
      .address = place_.master_addr,
      .port = place_.master_port,
      .rank = place_.rank,
      .world_size = place_.world_size,
      .serve_store = !place_.agent_store,
      .listen_fd = place_.store_listen_fd,
      .prefix = "dalle/" + std::to_string(place_.restart_count) + "/world",
      .timeout = options.timeout,
      .backend = options.backend,
      .cuda_device = options.cuda_device,
      .link = options.link});
  if (options.powersgd) {
    reducer_ = std::make_shared<PowerSgdReducer>(group_, *options.powersgd, options.overlap);
  } else {
    reducer_ = std::make_shared<DataParallelReducer>(group_, options.bucket_bytes, options.overlap);
  }
  const auto configs = ranks_differing(gather(static_cast<int64_t>(fingerprint.config)));
  const auto builds = ranks_differing(gather(static_cast<int64_t>(fingerprint.code)));
  if (!configs.empty() || !builds.empty()) {
    throw Error("the ranks of this job differ from rank 0 in their " +
                (configs.empty() ? "" : "config (rank " + configs + ")") +
                (!configs.empty() && !builds.empty() ? " and their " : "") +
                (builds.empty() ? "" : "build of dalle (rank " + builds + ")") +
                "; start every rank with the same command, config and installation");
  }
  log::info("joined a job of ", place_.world_size, " ranks as rank ", place_.rank, " (", place_.launcher,
            ", store at ", place_.master_addr, ":", place_.master_port, ")");
}

Job::~Job() {
  // Leaving because of an error (a lost rank, a mismatch): tearing the groups down would
  // wait on peers that may never answer, so their threads and sockets go with the process.
  if (std::uncaught_exceptions() > 0) {
    for (auto* group : {&group_, &within_node_, &across_nodes_}) {
      if (*group) new std::shared_ptr<ProcessGroup>(std::move(*group));  // deliberately never freed
    }
  }
}

// Subgroups are groups of their own over the same store, under prefixes of their own.
std::shared_ptr<ProcessGroup> Job::subgroup(const std::string& name, int64_t rank, int64_t size,
                                           const SimulatedLink& link) {
  return std::make_shared<ProcessGroup>(ProcessGroupOptions{
      .address = place_.master_addr,
      .port = place_.master_port,
      .rank = rank,
      .world_size = size,
      .serve_store = false,
      .prefix = "dalle/" + std::to_string(place_.restart_count) + "/" + name,
      .timeout = options_.timeout,
      .backend = options_.backend,
      .cuda_device = options_.cuda_device,
      .link = link});
}

// A group of its own even on one machine: the sharded blocks' gathers and reduce-scatters
// then never share an order with data parallelism's buckets on the world group, which each
// rank issues as its gradients come (a rank lacking a gradient would issue them otherwise).
// On one machine it carries the job's simulated link, as the world group does.
// A job of one has a group of its process alone: sharding over it keeps the model in units
// gathered one at a time (16-bit shards, no whole validation copy), dividing nothing.
std::shared_ptr<ProcessGroup> Job::within_node() {
  if (within_node_) return within_node_;
  if (!group_) {
    within_node_ = std::make_shared<ProcessGroup>(ProcessGroupOptions{.timeout = options_.timeout,
                                                                      .backend = options_.backend,
                                                                      .cuda_device = options_.cuda_device,
                                                                      .alone = true});
  } else {
    within_node_ = subgroup("node" + std::to_string(place_.node_rank), place_.local_rank, place_.local_world_size,
                            place_.nodes == 1 ? options_.link : SimulatedLink{});
  }
  return within_node_;
}

std::shared_ptr<ProcessGroup> Job::across_nodes() {
  if (place_.nodes == 1) return nullptr;
  if (!across_nodes_) {
    across_nodes_ = subgroup("local" + std::to_string(place_.local_rank), place_.node_rank, place_.nodes,
                             options_.link);
  }
  return across_nodes_;
}

std::vector<int64_t> Job::gather(int64_t value) {
  if (!group_) return {value};
  const auto on = torch::TensorOptions().dtype(torch::kInt64).device(group_->device());
  auto gathered = torch::empty({size()}, on);
  group_->all_gather(torch::tensor({value}, on), gathered);
  gathered = gathered.cpu();
  return {gathered.data_ptr<int64_t>(), gathered.data_ptr<int64_t>() + size()};
}

bool Job::any(bool yes) {
  if (!group_) return yes;
  auto flag = torch::tensor({yes ? 1.0f : 0.0f}).to(group_->device());
  group_->all_reduce(flag, ReduceOp::max);
  return flag.item<float>() > 0;
}

void Job::check_same(int64_t value, const std::string& what) {
  const auto values = gather(value);
  const auto ranks = ranks_differing(values);
  if (ranks.empty()) return;
  std::string seen;
  for (size_t r = 0; r < values.size(); ++r) seen += " rank " + std::to_string(r) + ": " + std::to_string(values[r]) + ";";
  throw Error("the ranks disagree on " + what + " (" + seen.substr(1, seen.size() - 2) + ")");
}

void Job::average(std::vector<double>& values) {
  if (!group_ || values.empty()) return;
  auto tensor = torch::tensor(values, torch::kFloat64).to(group_->device());
  group_->all_reduce(tensor, ReduceOp::average);
  tensor = tensor.cpu();
  for (size_t i = 0; i < values.size(); ++i) values[i] = tensor[static_cast<int64_t>(i)].item<double>();
}

void Job::barrier() {
  if (group_) group_->barrier();
}

}  // namespace dalle::distributed
