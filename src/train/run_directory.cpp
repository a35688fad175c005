#include "train/run_directory.h"

#include <ATen/Context.h>
#include <fcntl.h>
#include <sys/file.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "dalle/error.h"
#include "dalle/io/atomic_file.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/log.h"
#include "dalle/runtime.h"
#include "dalle/train/optimizer_state.h"
#include "dalle/train/stop_request.h"

namespace dalle::train {
namespace fs = std::filesystem;

namespace {

constexpr const char* kLockFile = ".lock";

}  // namespace

void check_run_directory(const fs::path& run, const std::string& what) {
  if (!fs::exists(run) || fs::is_empty(run)) return;
  // The lock file marks a run that stopped before its first metrics line.
  const bool a_run =
      fs::exists(run / io::kCheckpointsFolder) || fs::exists(run / "metrics.jsonl") || fs::exists(run / kLockFile);
  if (!fs::is_directory(run) || !a_run) {
    throw Error(run.string() + " exists and is not a " + what + " run directory; refusing to write into it");
  }
}

void MetricsLog::append(const nlohmann::json& line) const {
  if (path_.empty()) return;
  std::ofstream out(path_, std::ios::app);
  out << line.dump() << '\n';
}

void MetricsLog::drop_after(int64_t step) const {
  if (path_.empty() || !fs::exists(path_)) return;
  std::ifstream in(path_);
  std::string kept;
  for (std::string line; std::getline(in, line);) {
    auto entry = nlohmann::json::parse(line, nullptr, false);
    if (entry.is_object() && entry.value("step", int64_t{0}) <= step) kept += line + "\n";
  }
  io::write_file_atomic(path_.string(), kept);
}

void prepare_torch(int64_t threads, int64_t seed) {
  set_torch_threads(threads);
  torch::manual_seed(static_cast<uint64_t>(seed));
}

RunLock::RunLock(const fs::path& run, const std::string& what) {
  const auto path = (run / kLockFile).string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error(path + ": cannot open the run's lock file: " + std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    std::string holder(32, '\0');
    holder.resize(static_cast<size_t>(std::max<ssize_t>(::pread(fd_, holder.data(), holder.size(), 0), 0)));
    ::close(fd_);
    fd_ = -1;
    throw Error(run.string() + " is in use by another " + what + " run (process " +
                (holder.empty() ? "unknown" : holder) + " holds " + path +
                "); wait for it or train into another --out");
  }
  const auto pid = std::to_string(::getpid());
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
    log::warn(path, ": cannot record this process in the lock file");
  }
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // which releases the lock
}

RunLock::RunLock(RunLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

RunLock& RunLock::operator=(RunLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

RunRecord::RunRecord(std::string what, fs::path run, int64_t keep_checkpoints)
    : what(std::move(what)),
      run(std::move(run)),
      checkpoints((this->run / io::kCheckpointsFolder).string(), static_cast<int>(keep_checkpoints)),
      metrics_log(this->run / "metrics.jsonl"),
      should_stop([] { return stop_requested(); }) {}

void RunRecord::leave_files_to_another() {
  writes_files = false;
  metrics_log.disable();
}

void RunRecord::open(const ConfigVisit& config, bool samples, const std::function<void(const std::string&)>& resume) {
  if (!writes_files) {
    if (auto latest = checkpoints.latest()) resume(*latest);
    return;
  }
  fs::create_directories(run);
  lock = RunLock(run, what);
  if (auto latest = checkpoints.latest()) resume(*latest);
  if (samples) fs::create_directories(run / "samples");
  save_config((run / "config.yaml").string(), config);
}

void RunRecord::save(const io::Checkpoint& checkpoint) {
  if (!writes_files) return;
  log::info(what, ": checkpoint ", checkpoints.save(step, checkpoint));
}

void RunRecord::resumed(const std::string& directory, int64_t resumed_step) {
  step = resumed_step;
  metrics_log.drop_after(step);
  log::info(what, ": resumed from ", directory, " at update ", step);
}

void check_same_config(const std::vector<std::pair<std::string, std::string>>& before,
                       const std::vector<std::pair<std::string, std::string>>& now, const std::string& where,
                       const std::function<bool(const std::string&)>& may_change) {
  std::string changed;
  for (size_t i = 0; i < before.size() && i < now.size(); ++i) {
    if (before[i].second != now[i].second && !may_change(before[i].first)) {
      changed += " " + before[i].first + " (" + before[i].second + " -> " + now[i].second + ")";
    }
  }
  if (!changed.empty()) {
    throw Error(where + ": the run was started with a different config; changed:" + changed +
                ". Resume with the run's own config.yaml, or train into a new --out directory");
  }
}

io::Checkpoint make_checkpoint(std::string config_yaml, const torch::nn::Module& model, const Ema& ema,
                               torch::optim::AdamW& optimizer, int64_t step, data::LoaderPosition position) {
  return make_checkpoint(std::move(config_yaml), io::state_dict(model), ema.weights(), adamw_state(optimizer, model),
                         step, position);
}

io::Checkpoint make_checkpoint(std::string config_yaml, io::TensorMap weights, const io::TensorMap& ema_weights,
                               const io::TensorMap& adamw, int64_t step, data::LoaderPosition position) {
  io::Checkpoint checkpoint;
  checkpoint.config_yaml = std::move(config_yaml);
  checkpoint.weights = std::move(weights);
  for (const auto& [name, tensor] : ema_weights) checkpoint.state.emplace("ema." + name, tensor);
  for (const auto& [name, tensor] : adamw) checkpoint.state.emplace("adamw." + name, tensor);
  checkpoint.state.emplace("rng.torch", at::detail::getDefaultCPUGenerator().get_state());
  checkpoint.state_metadata = {{"step", std::to_string(step)},
                               {"torch_threads", std::to_string(at::get_num_threads())},
                               {"loader_epoch", std::to_string(position.epoch)},
                               {"loader_batch", std::to_string(position.batch)}};
  return checkpoint;
}

at::Generator seeded_generator(torch::Device device, uint64_t seed) {
  auto generator = at::globalContext().defaultGenerator(device).clone();
  generator.set_current_seed(seed);
  return generator;
}

void restore_generator(at::Generator& generator, const torch::Tensor& state, const std::string& what) {
  // CPU and CUDA generators keep states of different sizes (the Mersenne twister's, or a
  // seed and an offset), so a size mismatch is a device mismatch.
  if (state.numel() != generator.get_state().numel()) {
    log::warn(what, ": the checkpoint's noise generator was saved on another kind of device; it restarts from the seed");
    return;
  }
  generator.set_state(state);
}

RestoredProgress restore_checkpoint(const io::Checkpoint& checkpoint, const std::string& directory,
                                    torch::nn::Module& model, Ema& ema, torch::optim::AdamW& optimizer) {
  io::load_state_dict(model, checkpoint.weights, directory + "/" + io::kWeightsFile);
  ema.load(io::with_prefix_removed(checkpoint.state, "ema."));
  load_adamw_state(optimizer, model, io::with_prefix_removed(checkpoint.state, "adamw."));
  return restore_progress(checkpoint);
}

RestoredProgress restore_progress(const io::Checkpoint& checkpoint) {
  auto torch_generator = at::detail::getDefaultCPUGenerator();  // a handle: setting its state sets torch's
  torch_generator.set_state(checkpoint.state.at("rng.torch"));
  const auto& meta = checkpoint.state_metadata;
  return {std::stoll(meta.at("step")), {std::stoll(meta.at("loader_epoch")), std::stoll(meta.at("loader_batch"))}};
}

}  // namespace dalle::train
