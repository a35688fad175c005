#pragma once
// What every trainer does with its run directory: refuse to write into a foreign folder,
// append metrics, refuse a resume under a changed config, find the latest checkpoint.
#include <ATen/core/Generator.h>

#include <filesystem>
#include <functional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "dalle/config.h"
#include "dalle/data/loader.h"
#include "dalle/io/checkpoint.h"
#include "dalle/train/ema.h"

namespace dalle::train {

// A directory a trainer may write into: new, empty, or an earlier run (checkpoints/,
// metrics.jsonl or the run's lock file inside). `what` names the trainer in the error.
void check_run_directory(const std::filesystem::path& run, const std::string& what);

// metrics.jsonl: one JSON object per line, each with the update ("step") it belongs to.
class MetricsLog {
 public:
  explicit MetricsLog(std::filesystem::path path) : path_(std::move(path)) {}
  // From now on, appends and drops nothing (a rank that is not the job's first).
  void disable() { path_.clear(); }
  void append(const nlohmann::json& line) const;
  // Drops the lines of updates after `step`: a resumed run rewrites them.
  void drop_after(int64_t step) const;

 private:
  std::filesystem::path path_;
};

// Sets torch's CPU threads (0: its default) and seeds its generator, before a trainer builds
// its model.
void prepare_torch(int64_t threads, int64_t seed);

// An exclusive lock on a run directory (flock on <run>/.lock, which holds the owner's pid),
// held while a trainer writes into it: a second process given the same folder is refused
// rather than interleaving its checkpoints and metrics with the first's. The kernel drops
// the lock when the process ends, however it ends.
class RunLock {
 public:
  RunLock() = default;
  // Throws Error naming the holder when another RunLock, in this process or another, holds it.
  RunLock(const std::filesystem::path& run, const std::string& what);
  ~RunLock();
  RunLock(RunLock&& other) noexcept;
  RunLock& operator=(RunLock&& other) noexcept;

 private:
  int fd_ = -1;
};

// What every trainer keeps of its run: the folder, its checkpoints and metrics log, and the
// updates made so far. `what` names the trainer in the log. In a job of several processes
// every rank keeps one, and only the first writes into the folder.
struct RunRecord {
  RunRecord(std::string what, std::filesystem::path run, int64_t keep_checkpoints);

  // Locks the run's folder (creating it when new), resumes with `resume` from the latest
  // checkpoint, if there is one; then writes the run's config.yaml (and samples/ when
  // `samples`). In that order, so that a refused resume leaves the run as it was, but for
  // its lock file. A process that writes no files only resumes.
  void open(const ConfigVisit& config, bool samples, const std::function<void(const std::string&)>& resume);
  // Saves `checkpoint` as the current update's.
  void save(const io::Checkpoint& checkpoint);
  // This process leaves the folder to another: no lock, checkpoints, metrics or samples.
  void leave_files_to_another();
  // The end of a resume from `directory` at update `resumed_step`: the metrics of later
  // updates are dropped, since the run redoes them.
  void resumed(const std::string& directory, int64_t resumed_step);

  std::string what;
  std::filesystem::path run;
  io::CheckpointStore checkpoints;
  MetricsLog metrics_log;
  int64_t step = 0;
  // Wall time of the updates since the last metrics line (the loop times them; validation and
  // checkpoints are not in it), which the next metrics line reports per update.
  mutable double update_seconds = 0;
  mutable int64_t updates_timed = 0;
  RunLock lock;  // from open() on
  bool writes_files = true;
  // Whether to stop before the next update: this process's stop request (train/stop_request.h)
  // or, in a job, any rank's, so that every rank stops after the same update.
  std::function<bool()> should_stop;
};

// Throws unless `now` equals the config a checkpoint was written with, except for the keys
// `may_change` accepts (how long and how often, not what is trained).
void check_same_config(const std::vector<std::pair<std::string, std::string>>& before,
                       const std::vector<std::pair<std::string, std::string>>& now, const std::string& where,
                       const std::function<bool(const std::string&)>& may_change);

template <class Config>
void check_resumable(const Config& now, const std::string& checkpoint_yaml, const std::string& where,
                     const std::function<bool(const std::string&)>& may_change) {
  auto before = load_config<Config>(ConfigSource::from_string(checkpoint_yaml, where));
  auto current = now;
  check_same_config(flatten_config(visit_of(before)), flatten_config(visit_of(current)), where, may_change);
}

// What every trainer's checkpoint holds: the config, the weights, their moving average
// ("ema."), the AdamW moments ("adamw."), torch's generator, the update count, the loader's
// position and torch's CPU threads (whose count changes the last bits of CPU results). Trainers add their own extras to the result.
io::Checkpoint make_checkpoint(std::string config_yaml, const torch::nn::Module& model, const Ema& ema,
                               torch::optim::AdamW& optimizer, int64_t step, data::LoaderPosition position);
// The same from the named tensors themselves (a sharded model's, gathered whole).
io::Checkpoint make_checkpoint(std::string config_yaml, io::TensorMap weights, const io::TensorMap& ema_weights,
                               const io::TensorMap& adamw, int64_t step, data::LoaderPosition position);

struct RestoredProgress {
  int64_t step = 0;
  data::LoaderPosition position;
};
// A trainer's own generator for noise drawn on `device` (gumbel noise, code restarts).
at::Generator seeded_generator(torch::Device device, uint64_t seed);
// Restores a generator saved in a checkpoint. A run moved between CPU and GPU cannot restore
// one saved on the other kind of device: the generator keeps its seed, with a warning.
void restore_generator(at::Generator& generator, const torch::Tensor& state, const std::string& what);

// torch's generator, the update count and the loader's position, from a checkpoint.
RestoredProgress restore_progress(const io::Checkpoint& checkpoint);
// The inverse of make_checkpoint, into an already built model, EMA and optimizer.
RestoredProgress restore_checkpoint(const io::Checkpoint& checkpoint, const std::string& directory,
                                    torch::nn::Module& model, Ema& ema, torch::optim::AdamW& optimizer);

}  // namespace dalle::train
