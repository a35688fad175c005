#pragma once
// Where this process stands in a training job, read from the variables its launcher set,
// so that one binary with an unchanged command line runs under any of them: torchrun
// (`torchrun --no-python`) first, then Open MPI's mpirun (as a launcher only), then Slurm's
// srun. A process no launcher started is a job of one.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace dalle::distributed {

struct LaunchEnvironment {
  std::string launcher = "none";  // "torchrun", "mpirun", "slurm" or "none"
  int64_t rank = 0, world_size = 1;
  int64_t local_rank = 0, local_world_size = 1;  // within this machine
  int64_t node_rank = 0, nodes = 1;              // machines
  std::string master_addr = "127.0.0.1";         // where rank 0 serves the store
  int64_t master_port = 29500;                   // torch's default
  // torchrun: its agent already serves the store (every rank is a client), and a restarted
  // job prefixes the store's keys with its restart count.
  bool agent_store = false;
  int64_t restart_count = 0;
  // dalle's own --nproc-per-node (distributed/local_ranks.h) sets torchrun's variables, names
  // itself in DALLE_LAUNCHER and hands rank 0 the store's bound socket in DALLE_STORE_FD.
  int store_listen_fd = -1;
};

// A variable's value, or nothing when it is unset.
using Environment = std::function<std::optional<std::string>(const std::string&)>;
// The process's own environment.
std::optional<std::string> process_environment(const std::string& name);

// Reads the first launcher whose variables are set; throws Error naming the variable when
// one is malformed or the values disagree (a rank outside the world, ...).
LaunchEnvironment read_launch_environment(const Environment& environment = process_environment);

// The first host of a Slurm node list in its compressed form ("gpu[07-09,12],cpu1" ->
// "gpu07"), as `scontrol show hostnames` would list it first.
std::string first_slurm_host(const std::string& node_list);
// Slurm's tasks per node ("4(x2),3" -> {4, 4, 3}).
std::vector<int64_t> slurm_tasks_per_node(const std::string& tasks);

}  // namespace dalle::distributed
