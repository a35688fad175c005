#include "dalle/io/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <torch/torch.h>

#include "dalle/io/atomic_file.h"
#include "dalle/io/stale_temporaries.h"
#include "dalle/io/state_dict.h"
#include "dalle/log.h"
#include "io/checkpoint_files.h"

namespace dalle::io {
namespace fs = std::filesystem;

namespace {

constexpr const char* kConfigFile = "config.yaml";
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

// Renames the folder `built` to `target`, replacing a checkpoint already there: rename()
// cannot replace a non-empty directory, so the old one goes aside first, comes back if the
// rename fails, and is removed once the new one is in.
void rename_into_place(const fs::path& built, const fs::path& target) {
  std::optional<fs::path> previous;
  if (fs::exists(target)) {
    previous = temporary_sibling(target.string());
    fs::rename(target, *previous);
  }
  try {
    fs::rename(built, target);
  } catch (...) {
    if (previous) fs::rename(*previous, target);  // put the old checkpoint back
    throw;
  }
  if (previous) fs::remove_all(*previous);
}

}  // namespace

void detail::write_files(const std::string& folder, const Checkpoint& checkpoint,
                         const std::vector<TensorSpec>& streamed, const std::function<void(SafetensorsWriter&)>& write) {
  const fs::path root(folder);
  write_file_atomic((root / kConfigFile).string(), checkpoint.config_yaml);
  if (!write) {
    write_safetensors((root / kWeightsFile).string(), checkpoint.weights);
  } else {
    auto specs = specs_of(checkpoint.weights);
    const size_t own = specs.size();
    specs.insert(specs.end(), streamed.begin(), streamed.end());
    write_file_atomic((root / kWeightsFile).string(), [&](std::ostream& out) {
      SafetensorsWriter writer(out, specs);
      for (size_t i = 0; i < own; ++i) writer.write(specs[i].name, checkpoint.weights.at(specs[i].name));
      write(writer);
      writer.finish();
    });
  }
  write_safetensors((root / kStateFile).string(), checkpoint.state, checkpoint.state_metadata);
}

Checkpoint detail::read_files(const std::string& directory) {
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

namespace {

// A checkpoint directory `fill` writes into a staging folder, renamed into place once complete.
void save_into_place(const std::string& directory, const std::function<void(const std::string&)>& fill) {
  const fs::path target(directory);
  if (target.has_parent_path()) fs::create_directories(target.parent_path());
  remove_stale_temporaries(directory);
  const fs::path staging(temporary_sibling(directory));
  try {
    fs::create_directory(staging);
    fill(staging.string());
    rename_into_place(staging, target);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
}

}  // namespace

void save_checkpoint(const std::string& directory, const Checkpoint& checkpoint) {
  save_into_place(directory, [&](const std::string& staging) { detail::write_files(staging, checkpoint); });
}

void save_checkpoint(const std::string& directory, const std::string& config_yaml,
                     const std::vector<TensorSpec>& weights, const std::function<void(SafetensorsWriter&)>& write) {
  save_into_place(directory, [&](const std::string& staging) {
    Checkpoint weights_alone;
    weights_alone.config_yaml = config_yaml;
    detail::write_files(staging, weights_alone, weights, write);
  });
}

namespace {

constexpr const char* kBaseKey = "base_checkpoint";
constexpr const char* kBaseFingerprintKey = "base_fingerprint";

// Size and 64 evenly spread 4 KiB blocks of a file, FNV-1a hashed: cheap on a file of
// gigabytes, and enough to tell another file or a rewritten one from the same one.
std::string file_fingerprint(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path.string() + ": cannot be read");
  const auto size = fs::file_size(path);
  uint64_t hash = 1469598103934665603ull;
  std::vector<char> block(4096);
  constexpr uint64_t kBlocks = 64;
  for (uint64_t b = 0; b < kBlocks; ++b) {
    in.seekg(static_cast<std::streamoff>(size / kBlocks * b));
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    for (std::streamsize i = 0; i < in.gcount(); ++i) hash = (hash ^ static_cast<unsigned char>(block[i])) * 1099511628211ull;
    in.clear();
  }
  std::ostringstream text;
  text << size << ":" << std::hex << hash;
  return text.str();
}

}  // namespace

void detail::fill_from_base(Checkpoint& checkpoint, const std::string& directory, ShardedWeights* unread) {
  const auto base = base_of(checkpoint);
  if (base.empty()) return;
  const auto where = directory + " (fine-tuned from " + base + ")";
  if (!fs::exists(fs::path(base) / kWeightsFile)) {
    throw Error(where + ": its base checkpoint is gone; the checkpoint holds only what was trained, and needs the "
                "base it was trained from at that path");
  }
  const auto fingerprint = checkpoint.state_metadata.find(kBaseFingerprintKey);
  if (fingerprint == checkpoint.state_metadata.end()) {
    throw Error(where + ": names a base without its fingerprint; not a checkpoint dalle wrote");
  }
  if (file_fingerprint(fs::path(base) / kWeightsFile) != fingerprint->second) {
    throw Error(where + ": the base checkpoint's weights changed since the run started from them; put the "
                "original back at that path");
  }
  const auto read = unread ? load_inference_checkpoint(base, *unread) : load_inference_checkpoint(base);
  for (auto& [name, tensor] : inference_weights(read)) checkpoint.weights.emplace(name, std::move(tensor));
}

std::string checkpoint_config(const std::string& directory) {
  const auto path = fs::path(directory) / kConfigFile;
  if (!fs::exists(path)) throw Error(directory + ": incomplete checkpoint, " + kConfigFile + " is missing");
  return read_text(path);
}

Checkpoint load_checkpoint(const std::string& directory) {
  auto checkpoint = detail::read_files(directory);
  detail::join_shards(directory, checkpoint);
  detail::fill_from_base(checkpoint, directory);
  return checkpoint;
}

TensorMap inference_weights(const Checkpoint& checkpoint) {
  auto weights = checkpoint.weights;
  for (auto& [name, tensor] : with_prefix_removed(checkpoint.state, "ema.")) weights[name] = std::move(tensor);
  return weights;
}

Checkpoint load_inference_checkpoint(const std::string& directory) {
  auto checkpoint = detail::read_files(directory);
  detail::join_shards(directory, checkpoint, /*inference_only=*/true);
  detail::fill_from_base(checkpoint, directory);
  return checkpoint;
}

void refer_to_base(Checkpoint& checkpoint, const std::string& base_directory) {
  const auto base = fs::absolute(base_directory).lexically_normal();
  checkpoint.state_metadata[kBaseKey] = base.string();
  checkpoint.state_metadata[kBaseFingerprintKey] = file_fingerprint(base / kWeightsFile);
}

std::string base_of(const Checkpoint& checkpoint) {
  const auto found = checkpoint.state_metadata.find(kBaseKey);
  return found == checkpoint.state_metadata.end() ? "" : found->second;
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
  make_latest(directory);
  return directory;
}

std::string CheckpointStore::staging_for(int64_t step) const { return directory_for(step) + ".staging"; }

void CheckpointStore::stage(int64_t step) const {
  // Any staging folder is a leftover of a job killed while writing: only rank 0 stages, and
  // it publishes before it stages again.
  if (fs::is_directory(root_)) {
    for (const auto& entry : fs::directory_iterator(root_)) {
      if (entry.is_directory() && entry.path().extension() == ".staging") fs::remove_all(entry.path());
    }
  }
  fs::create_directories(staging_for(step));
}

std::string CheckpointStore::publish(int64_t step) {
  const std::string directory = directory_for(step);
  // A checkpoint of the same update, from an earlier attempt, goes aside until this one is in.
  rename_into_place(staging_for(step), directory);
  make_latest(directory);
  return directory;
}

void CheckpointStore::make_latest(const std::string& directory) const {
  write_file_atomic((fs::path(root_) / "latest").string(), fs::path(directory).filename().string() + "\n");
  prune();
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

void CheckpointStore::mark_best(int64_t step) const {
  write_file_atomic((fs::path(root_) / "best").string(), fs::path(directory_for(step)).filename().string() + "\n");
}

std::optional<std::string> CheckpointStore::best() const {
  const fs::path pointer = fs::path(root_) / "best";
  if (!fs::exists(pointer)) return std::nullopt;
  std::string name = read_text(pointer);
  name.erase(name.find_last_not_of(" \n\r\t") + 1);
  const fs::path directory = fs::path(root_) / name;
  if (step_of(directory) && fs::is_directory(directory)) return directory.string();
  log::warn(pointer.string(), " names '", name, "', which is missing; using the latest checkpoint");
  return std::nullopt;
}

void CheckpointStore::prune() const {
  if (keep_ <= 0) return;
  const auto found = steps();
  const auto kept = best();
  for (size_t i = 0; i + static_cast<size_t>(keep_) < found.size(); ++i) {
    if (kept && directory_for(found[i]) == *kept) continue;
    fs::remove_all(directory_for(found[i]));
  }
}

std::string resolve_checkpoint(const std::string& run_or_checkpoint, const std::string& what) {
  if (fs::exists(fs::path(run_or_checkpoint) / kWeightsFile)) return run_or_checkpoint;
  const CheckpointStore store((fs::path(run_or_checkpoint) / kCheckpointsFolder).string());
  if (auto best = store.best()) return *best;
  auto latest = store.latest();
  if (!latest) throw Error(run_or_checkpoint + ": neither a " + what + " checkpoint nor a run with checkpoints");
  return *latest;
}

}  // namespace dalle::io
