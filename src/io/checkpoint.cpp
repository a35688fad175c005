#include "dalle/io/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dalle/io/atomic_file.h"
#include "dalle/io/stale_temporaries.h"
#include "dalle/log.h"

namespace dalle::io {
namespace fs = std::filesystem;

namespace {

constexpr const char* kConfigFile = "config.yaml";
constexpr const char* kWeightsFile = "model.safetensors";
constexpr const char* kStateFile = "state.safetensors";
constexpr const char* kStepPrefix = "step-";

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path.string() + ": cannot open");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::optional<int64_t> step_of(const fs::path& directory) {
  const std::string name = directory.filename().string();
  if (name.rfind(kStepPrefix, 0) != 0) return std::nullopt;
  const std::string digits = name.substr(std::char_traits<char>::length(kStepPrefix));
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return std::nullopt;
  return std::stoll(digits);
}

}  // namespace

void save_checkpoint(const std::string& directory, const Checkpoint& checkpoint) {
  const fs::path target(directory);
  if (target.has_parent_path()) fs::create_directories(target.parent_path());
  remove_stale_temporaries(directory);
  const fs::path staging(temporary_sibling(directory));
  try {
    fs::create_directory(staging);
    write_file_atomic((staging / kConfigFile).string(), checkpoint.config_yaml);
    write_safetensors((staging / kWeightsFile).string(), checkpoint.weights);
    write_safetensors((staging / kStateFile).string(), checkpoint.state, checkpoint.state_metadata);
    // rename() cannot replace a non-empty directory: move the old one aside first.
    std::optional<fs::path> previous;
    if (fs::exists(target)) {
      previous = temporary_sibling(directory);
      fs::rename(target, *previous);
    }
    try {
      fs::rename(staging, target);
    } catch (...) {
      if (previous) fs::rename(*previous, target);  // put the old checkpoint back
      throw;
    }
    if (previous) fs::remove_all(*previous);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
}

Checkpoint load_checkpoint(const std::string& directory) {
  const fs::path root(directory);
  if (!fs::is_directory(root)) throw Error(directory + ": no checkpoint directory here");
  for (const char* file : {kConfigFile, kWeightsFile, kStateFile}) {
    if (!fs::exists(root / file)) throw Error(directory + ": incomplete checkpoint, " + file + " is missing");
  }
  Checkpoint checkpoint;
  checkpoint.config_yaml = read_text(root / kConfigFile);
  checkpoint.weights = read_safetensors((root / kWeightsFile).string()).tensors;
  auto state = read_safetensors((root / kStateFile).string());
  checkpoint.state = std::move(state.tensors);
  checkpoint.state_metadata = std::move(state.metadata);
  return checkpoint;
}

CheckpointStore::CheckpointStore(std::string root, int keep) : root_(std::move(root)), keep_(keep) {}

std::string CheckpointStore::directory_for(int64_t step) const {
  char name[32];
  std::snprintf(name, sizeof name, "%s%09lld", kStepPrefix, static_cast<long long>(step));
  return (fs::path(root_) / name).string();
}

std::string CheckpointStore::save(int64_t step, const Checkpoint& checkpoint) {
  const std::string directory = directory_for(step);
  remove_stale_temporaries_in(root_);  // the steps a killed run was writing
  save_checkpoint(directory, checkpoint);
  write_file_atomic((fs::path(root_) / "latest").string(), fs::path(directory).filename().string() + "\n");
  prune();
  return directory;
}

std::vector<int64_t> CheckpointStore::steps() const {
  std::vector<int64_t> found;
  if (!fs::is_directory(root_)) return found;
  for (const auto& entry : fs::directory_iterator(root_)) {
    if (!entry.is_directory()) continue;
    if (auto step = step_of(entry.path())) found.push_back(*step);
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::optional<std::string> CheckpointStore::latest() const {
  const fs::path pointer = fs::path(root_) / "latest";
  if (fs::exists(pointer)) {
    std::string name = read_text(pointer);
    name.erase(name.find_last_not_of(" \n\r\t") + 1);
    const fs::path directory = fs::path(root_) / name;
    if (step_of(directory) && fs::is_directory(directory)) return directory.string();
    log::warn(pointer.string(), " names '", name, "', which is missing; using the newest step directory");
  }
  const auto found = steps();
  if (found.empty()) return std::nullopt;
  return directory_for(found.back());
}

void CheckpointStore::prune() const {
  if (keep_ <= 0) return;
  const auto found = steps();
  for (size_t i = 0; i + static_cast<size_t>(keep_) < found.size(); ++i) {
    fs::remove_all(directory_for(found[i]));
  }
}

std::string resolve_checkpoint(const std::string& run_or_checkpoint, const std::string& what) {
  if (fs::exists(fs::path(run_or_checkpoint) / "model.safetensors")) return run_or_checkpoint;
  auto latest = CheckpointStore((fs::path(run_or_checkpoint) / "checkpoints").string()).latest();
  if (!latest) throw Error(run_or_checkpoint + ": neither a " + what + " checkpoint nor a run with checkpoints");
  return *latest;
}

}  // namespace dalle::io
