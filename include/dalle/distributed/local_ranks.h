#pragma once
// dalle's own launcher for one machine, as torchrun's standalone mode: this program forks
// N ranks of itself on 127.0.0.1, with torchrun's variables set, and watches them. It binds
// the store's port itself and hands the socket to rank 0 (no other process can take the port
// in between, and the store listens on loopback only). SIGINT or SIGTERM to the launcher
// reaches every rank once; when a rank fails, the others are ended at once, so that a job
// never outlives a lost rank.
#include <cstdint>
#include <string>
#include <vector>

namespace dalle::distributed {

struct LocalRanksOptions {
  int64_t ranks = 2;
  std::vector<std::string> arguments;  // the command line, argv[0] first
  int64_t threads_per_rank = 1;        // OMP_NUM_THREADS for each rank, unless the caller set one
};

struct LocalRanksOutcome {
  int exit_status = 0;       // the launcher's: 0, the first failed rank's, or 128 + a stop signal
  int64_t failed_rank = -1;  // the first rank that failed, if any...
  std::string failure;       // ...and how: "exited with status 1", "was killed by signal 9 (Killed)"
};

// Runs the ranks to their end.
LocalRanksOutcome run_local_ranks(const LocalRanksOptions& options);

}  // namespace dalle::distributed
