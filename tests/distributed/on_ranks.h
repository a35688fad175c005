#pragma once
// Several ranks in one test process: one thread each, over one store on 127.0.0.1 that the
// test serves on a port the kernel chose (no races between tests run side by side).
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "dalle/distributed/launch.h"
#include "dalle/distributed/process_group.h"

namespace dalle::testing {

// Runs `body(place)` for every rank of a world of `world`, where `place` says where the rank
// stands as a launcher's agent store would (every rank a client of the test's store).
template <class Body>
void on_ranks(int64_t world, Body body) {
  c10d::TCPStoreOptions options;
  options.port = 0;
  options.isServer = true;
  options.waitWorkers = false;
  const auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
  std::vector<std::future<void>> ranks;
  for (int64_t rank = 0; rank < world; ++rank) {
    distributed::LaunchEnvironment place;
    place.launcher = "test";
    place.rank = place.local_rank = rank;
    place.world_size = place.local_world_size = world;
    place.master_port = store->getPort();
    place.agent_store = true;
    ranks.push_back(std::async(std::launch::async, [place, &body] { body(place); }));
  }
  for (auto& rank : ranks) rank.get();
}

// The mean over `world` ranks of the gradients of `parameters_of_rank(rank)`, as exact
// averaging would make them.
template <class Parameters>
std::vector<torch::Tensor> mean_gradients(int64_t world, Parameters parameters_of_rank) {
  std::vector<torch::Tensor> mean;
  for (int64_t rank = 0; rank < world; ++rank) {
    const auto parameters = parameters_of_rank(rank);
    if (mean.empty()) mean.resize(parameters.size());
    for (size_t i = 0; i < parameters.size(); ++i) {
      const auto share = parameters[i].grad() / static_cast<double>(world);
      mean[i] = mean[i].defined() ? mean[i] + share : share;
    }
  }
  return mean;
}

// The process group of the rank at `place`, over the test's store (over `link`, when given).
inline std::shared_ptr<distributed::ProcessGroup> group_at(const distributed::LaunchEnvironment& place,
                                                           const distributed::SimulatedLink& link = {}) {
  return std::make_shared<distributed::ProcessGroup>(
      distributed::ProcessGroupOptions{.port = place.master_port,
                                       .rank = place.rank,
                                       .world_size = place.world_size,
                                       .serve_store = false,
                                       .timeout = std::chrono::seconds(30),
                                       .link = link});
}

// The group `name` of `size` ranks, over the test's store, in which the rank at `place` is
// `rank` (a machine's ranks, or one rank of each machine).
inline std::shared_ptr<distributed::ProcessGroup> subgroup_at(const distributed::LaunchEnvironment& place,
                                                              const std::string& name, int64_t rank, int64_t size) {
  return std::make_shared<distributed::ProcessGroup>(
      distributed::ProcessGroupOptions{.port = place.master_port,
                                       .rank = rank,
                                       .world_size = size,
                                       .serve_store = false,
                                       .prefix = name,
                                       .timeout = std::chrono::seconds(30)});
}

}  // namespace dalle::testing
