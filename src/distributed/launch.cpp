#include "dalle/distributed/launch.h"

#include <algorithm>
#include <cstdlib>

#include "dalle/error.h"
#include "dalle/input_limits.h"

namespace dalle::distributed {

namespace {

// Strict: digits only, as launchers write them; anything else names the variable.
int64_t parse_count(const std::string& name, const std::string& text) {
  if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos) {
    throw Error(name + "=" + excerpt(text, 40) + ": expected a non-negative integer");
  }
  return std::stoll(text);
}

class Variables {
 public:
  explicit Variables(const Environment& environment) : environment_(environment) {}

  bool has(const std::string& name) const { return environment_(name).has_value(); }
  std::optional<std::string> text(const std::string& name) const { return environment_(name); }
  int64_t count(const std::string& name) const {
    const auto value = environment_(name);
    if (!value) throw Error(name + " is not set, though the launcher's other variables are");
    return parse_count(name, *value);
  }
  int64_t count_or(const std::string& name, int64_t fallback) const {
    const auto value = environment_(name);
    return value ? parse_count(name, *value) : fallback;
  }

 private:
  const Environment& environment_;
};

void read_master(const Variables& v, LaunchEnvironment& job) {
  if (auto addr = v.text("MASTER_ADDR")) job.master_addr = *addr;
  job.master_port = v.count_or("MASTER_PORT", job.master_port);
}

// The variables a launcher names a process's place with, where it gives the processes of a
// machine by their count (torchrun, mpirun), so that the machines are world / local.
struct PlaceVariables {
  const char* launcher;
  const char *rank, *world_size, *local_rank, *local_world_size, *node_rank;
};
constexpr PlaceVariables kTorchrun{"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"};
constexpr PlaceVariables kMpirun{"mpirun",
                                 "OMPI_COMM_WORLD_RANK",
                                 "OMPI_COMM_WORLD_SIZE",
                                 "OMPI_COMM_WORLD_LOCAL_RANK",
                                 "OMPI_COMM_WORLD_LOCAL_SIZE",
                                 // Open MPI's NODE_RANK is a rank within the machine, not the
                                 // machine's index: that follows from mpirun's default mapping,
                                 // which fills each machine's slots in rank order.
                                 nullptr};

LaunchEnvironment read_place(const Variables& v, const PlaceVariables& names) {
  LaunchEnvironment job;
  job.launcher = names.launcher;
  job.rank = v.count(names.rank);
  job.world_size = v.count(names.world_size);
  job.local_rank = v.count(names.local_rank);
  job.local_world_size = v.count(names.local_world_size);
  job.node_rank = names.node_rank ? v.count_or(names.node_rank, 0)
                                  : job.rank / std::max<int64_t>(job.local_world_size, 1);
  job.nodes = job.local_world_size > 0 ? job.world_size / job.local_world_size : 0;
  read_master(v, job);
  return job;
}

LaunchEnvironment from_torchrun(const Variables& v) {
  auto job = read_place(v, kTorchrun);
  job.agent_store = v.text("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  job.restart_count = v.count_or("TORCHELASTIC_RESTART_COUNT", 0);
  if (auto launcher = v.text("DALLE_LAUNCHER")) job.launcher = *launcher;
  job.store_listen_fd = static_cast<int>(v.count_or("DALLE_STORE_FD", -1));
  return job;
}

LaunchEnvironment from_mpirun(const Variables& v) {
  auto job = read_place(v, kMpirun);
  if (job.nodes > 1 && !v.has("MASTER_ADDR")) {
    throw Error("mpirun across " + std::to_string(job.nodes) +
                " machines: set MASTER_ADDR to rank 0's host (mpirun -x MASTER_ADDR=host -x MASTER_PORT=port)");
  }
  return job;
}

LaunchEnvironment from_slurm(const Variables& v) {
  LaunchEnvironment job;
  job.launcher = "slurm";
  job.rank = v.count("SLURM_PROCID");
  job.world_size = v.count("SLURM_NTASKS");
  job.local_rank = v.count("SLURM_LOCALID");
  job.node_rank = v.count("SLURM_NODEID");
  job.nodes = v.count("SLURM_NNODES");
  const auto per_node = slurm_tasks_per_node(v.text("SLURM_TASKS_PER_NODE").value_or(std::to_string(job.world_size)));
  if (job.node_rank >= static_cast<int64_t>(per_node.size())) {
    throw Error("SLURM_TASKS_PER_NODE names " + std::to_string(per_node.size()) + " nodes, but SLURM_NODEID is " +
                std::to_string(job.node_rank));
  }
  job.local_world_size = per_node[static_cast<size_t>(job.node_rank)];
  const auto nodes = v.text("SLURM_JOB_NODELIST") ? v.text("SLURM_JOB_NODELIST") : v.text("SLURM_NODELIST");
  if (nodes) job.master_addr = first_slurm_host(*nodes);
  read_master(v, job);
  return job;
}

void check(const LaunchEnvironment& job) {
  const auto refuse = [&job](const std::string& what) {
    throw Error(job.launcher + "'s variables disagree: " + what);
  };
  if (job.world_size < 1) refuse("a world of " + std::to_string(job.world_size) + " processes");
  if (job.rank >= job.world_size) {
    refuse("rank " + std::to_string(job.rank) + " of a world of " + std::to_string(job.world_size));
  }
  if (job.local_world_size < 1 || job.local_world_size > job.world_size) {
    refuse(std::to_string(job.local_world_size) + " processes per machine in a world of " +
           std::to_string(job.world_size));
  }
  if (job.local_rank >= job.local_world_size) {
    refuse("local rank " + std::to_string(job.local_rank) + " of " + std::to_string(job.local_world_size));
  }
  if (job.nodes < 1 || job.node_rank >= job.nodes) {
    refuse("machine " + std::to_string(job.node_rank) + " of " + std::to_string(job.nodes));
  }
  // Parameters are sharded within a machine and replicated across machines: every machine
  // must run as many processes.
  if (job.world_size != job.local_world_size * job.nodes) {
    refuse(std::to_string(job.world_size) + " processes are not " + std::to_string(job.nodes) + " machines of " +
           std::to_string(job.local_world_size) + "; run as many on every machine");
  }
  if (job.master_port < 1 || job.master_port > 65535) refuse("MASTER_PORT " + std::to_string(job.master_port));
  if (job.master_addr.empty()) refuse("an empty MASTER_ADDR");
}

}  // namespace

std::optional<std::string> process_environment(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  return value ? std::optional<std::string>(value) : std::nullopt;
}

LaunchEnvironment read_launch_environment(const Environment& environment) {
  const Variables v(environment);
  LaunchEnvironment job;
  if (v.has(kTorchrun.rank) && v.has(kTorchrun.world_size)) {
    job = from_torchrun(v);
  } else if (v.has(kMpirun.rank)) {
    job = from_mpirun(v);
  } else if (v.has("SLURM_PROCID") && v.has("SLURM_STEP_ID")) {
    // Only in a job step (srun): a batch script's own process is not one of the ranks.
    job = from_slurm(v);
  }
  check(job);
  return job;
}

std::string first_slurm_host(const std::string& node_list) {
  std::string host;
  for (size_t i = 0; i < node_list.size() && node_list[i] != ','; ++i) {
    if (node_list[i] != '[') {
      host += node_list[i];
      continue;
    }
    const size_t close = node_list.find(']', i);
    if (close == std::string::npos) throw Error("SLURM_JOB_NODELIST=" + excerpt(node_list, 60) + ": an unclosed '['");
    const std::string range = node_list.substr(i + 1, close - i - 1);
    host += range.substr(0, range.find_first_of(",-"));
    i = close;
  }
  if (host.empty()) throw Error("SLURM_JOB_NODELIST=" + excerpt(node_list, 60) + ": no host");
  return host;
}

std::vector<int64_t> slurm_tasks_per_node(const std::string& tasks) {
  std::vector<int64_t> per_node;
  size_t begin = 0;
  while (begin <= tasks.size()) {
    const size_t end = std::min(tasks.find(',', begin), tasks.size());
    const std::string item = tasks.substr(begin, end - begin);
    const size_t repeat = item.find("(x");
    const int64_t count = parse_count("SLURM_TASKS_PER_NODE", item.substr(0, repeat));
    int64_t times = 1;
    if (repeat != std::string::npos) {
      if (item.back() != ')') throw Error("SLURM_TASKS_PER_NODE=" + excerpt(tasks, 60) + ": expected N(xK)");
      times = parse_count("SLURM_TASKS_PER_NODE", item.substr(repeat + 2, item.size() - repeat - 3));
    }
    if (times > 1'000'000) throw Error("SLURM_TASKS_PER_NODE=" + excerpt(tasks, 60) + ": too many nodes");
    per_node.insert(per_node.end(), static_cast<size_t>(times), count);
    begin = end + 1;
  }
  return per_node;
}

}  // namespace dalle::distributed
