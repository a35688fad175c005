#include "dalle/io/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dalle/io/atomic_file.h"
#include "dalle/io/stale_temporaries.h"
#include "dalle/io/state_dict.h"
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

namespace {

constexpr const char* kLayoutKey = "shard_layout";
constexpr const char* kBaseKey = "base_checkpoint";
constexpr const char* kBaseFingerprintKey = "base_fingerprint";

std::string shard_file(int64_t rank, int64_t ranks) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05lld-of-%05lld.safetensors", static_cast<long long>(rank),
                static_cast<long long>(ranks));
  return name;
}

std::string layout_json(const ShardLayout& layout) {
  nlohmann::json json;
  json["ranks"] = layout.ranks;
  json["groups"] = nlohmann::json::array();
  for (const auto& group : layout.groups) {
    auto parameters = nlohmann::json::array();
    for (const auto& parameter : group) parameters.push_back({{"name", parameter.name}, {"shape", parameter.shape}});
    json["groups"].push_back(parameters);
  }
  for (const auto& [kind, where] : layout.kinds) {
    json["kinds"][kind] = {{"into", where.into_weights ? "weights" : "state"}, {"prefix", where.prefix},
                           {"suffix", where.suffix}};
  }
  return json.dump();
}

ShardLayout parse_layout(const fs::path& directory, const std::string& layout_text) {
  const auto json = nlohmann::json::parse(layout_text, nullptr, false);
  if (json.is_discarded() || !json.contains("ranks") || !json.contains("groups") || !json.contains("kinds")) {
    throw Error(directory.string() + ": the checkpoint's shard layout is unreadable");
  }
  ShardLayout layout{.ranks = json["ranks"].get<int64_t>()};
  for (const auto& group : json["groups"]) {
    std::vector<ShardLayout::Parameter> parameters;
    for (const auto& parameter : group) {
      parameters.push_back({parameter["name"].get<std::string>(), parameter["shape"].get<std::vector<int64_t>>()});
    }
    layout.groups.push_back(std::move(parameters));
  }
  for (const auto& [kind, where] : json["kinds"].items()) {
    layout.kinds[kind] = {.into_weights = where["into"] == "weights",
                          .prefix = where["prefix"].get<std::string>(),
                          .suffix = where["suffix"].get<std::string>()};
  }
  return layout;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (const auto size : shape) numel *= size;
  return numel;
}

int64_t values_of(const std::vector<ShardLayout::Parameter>& group) {
  int64_t values = 0;
  for (const auto& parameter : group) values += numel_of(parameter.shape);
  return values;
}

std::string slice_key(const std::string& kind, size_t group) { return kind + "." + std::to_string(group); }

std::string name_in(const ShardLayout::Kind& where, const std::string& parameter) {
  return where.prefix + parameter + where.suffix;
}

// Joins the shards of `directory` into `checkpoint`, as `layout` lays them out.
void join_shards(const fs::path& directory, const ShardLayout& layout, Checkpoint& checkpoint) {
  std::vector<TensorMap> shards;
  for (int64_t rank = 0; rank < layout.ranks; ++rank) {
    const auto path = directory / shard_file(rank, layout.ranks);
    if (!fs::exists(path)) throw Error(directory.string() + ": incomplete checkpoint, " + path.filename().string() + " is missing");
    shards.push_back(read_safetensors(path.string()).tensors);
  }
  for (const auto& [kind, where] : layout.kinds) {
    auto& target = where.into_weights ? checkpoint.weights : checkpoint.state;
    for (size_t g = 0; g < layout.groups.size(); ++g) {
      const std::string key = slice_key(kind, g);
      std::vector<torch::Tensor> parts;
      for (const auto& shard : shards) {
        const auto found = shard.find(key);
        if (found == shard.end()) throw Error(directory.string() + ": a shard lacks '" + key + "'");
        parts.push_back(found->second.reshape({-1}));
      }
      const auto flat = torch::cat(parts);
      int64_t offset = 0;
      for (const auto& parameter : layout.groups[g]) {
        const int64_t numel = numel_of(parameter.shape);
        if (offset + numel > flat.numel()) throw Error(directory.string() + ": the shards of '" + key + "' are short");
        target[name_in(where, parameter.name)] = flat.narrow(0, offset, numel).view(parameter.shape).clone();
        offset += numel;
      }
    }
  }
}

// Copies the values [low, high) of a group's flat values into `slice` (which starts at
// `low`), from pieces that each hold the values [start, start + numel): only what overlaps
// is read.
struct Piece {
  int64_t start;
  torch::Tensor values;  // flat
};
int64_t copy_overlap(const Piece& piece, int64_t low, int64_t high, torch::Tensor& slice) {
  const int64_t from = std::max(low, piece.start), to = std::min(high, piece.start + piece.values.numel());
  if (to <= from) return 0;
  slice.narrow(0, from - low, to - from).copy_(piece.values.narrow(0, from - piece.start, to - from));
  return (to - from) * static_cast<int64_t>(piece.values.element_size());
}

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

// The base's inference weights into every name `checkpoint` lacks (refer_to_base).
void fill_from_base(Checkpoint& checkpoint, const std::string& directory) {
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
  for (auto& [name, tensor] : inference_weights(load_checkpoint(base))) checkpoint.weights.emplace(name, std::move(tensor));
}

// Rank 0's files, the shards left where they are.
Checkpoint load_checkpoint_files(const std::string& directory) {
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

}  // namespace

RankCheckpoint load_checkpoint_for_rank(const std::string& directory, const ShardLayout& wanted, int64_t rank,
                                        int64_t ranks) {
  const fs::path root(directory);
  RankCheckpoint result;
  result.replicated = load_checkpoint_files(directory);
  auto& checkpoint = result.replicated;
  fill_from_base(checkpoint, directory);
  std::optional<ShardLayout> written;
  if (const auto layout = checkpoint.state_metadata.find(kLayoutKey); layout != checkpoint.state_metadata.end()) {
    written = parse_layout(root, layout->second);
    checkpoint.state_metadata.erase(layout);
    if (written->groups.size() != wanted.groups.size()) {
      throw Error(directory + ": the checkpoint's shards hold " + std::to_string(written->groups.size()) +
                  " groups where the model has " + std::to_string(wanted.groups.size()));
    }
  }
  std::map<int64_t, Safetensors> shard_files;  // mapped when first needed
  const auto shard_of_rank = [&](int64_t writer) -> const TensorMap& {
    auto found = shard_files.find(writer);
    if (found == shard_files.end()) {
      const auto path = root / shard_file(writer, written->ranks);
      if (!fs::exists(path)) {
        throw Error(directory + ": incomplete checkpoint, " + path.filename().string() + " is missing");
      }
      found = shard_files.emplace(writer, read_safetensors(path.string())).first;
    }
    return found->second.tensors;
  };
  for (const auto& [kind, where] : wanted.kinds) {
    if (written && !written->kinds.count(kind)) continue;
    for (size_t g = 0; g < wanted.groups.size(); ++g) {
      const int64_t values = values_of(wanted.groups[g]);
      const int64_t share = (values + ranks - 1) / ranks, low = rank * share, high = std::min(values, low + share);
      auto slice = torch::zeros({share});
      if (values == 0) {  // an empty group (a block whose matrices are all frozen)
        result.slices.emplace(slice_key(kind, g), std::move(slice));
        continue;
      }
      if (written) {
        if (values_of(written->groups[g]) != values) {
          throw Error(directory + ": the checkpoint's shard group " + std::to_string(g) + " holds " +
                      std::to_string(values_of(written->groups[g])) + " values where the model has " +
                      std::to_string(values));
        }
        const int64_t written_share = (values + written->ranks - 1) / written->ranks;
        for (int64_t writer = low / written_share; writer < written->ranks && writer * written_share < high; ++writer) {
          const auto& shard = shard_of_rank(writer);
          const auto found = shard.find(slice_key(kind, g));
          if (found == shard.end()) throw Error(directory + ": a shard lacks '" + slice_key(kind, g) + "'");
          result.shard_bytes_read[writer] +=
              copy_overlap({writer * written_share, found->second.reshape({-1})}, low, high, slice);
        }
      } else {
        auto& source = where.into_weights ? checkpoint.weights : checkpoint.state;
        int64_t start = 0, present = 0;
        for (const auto& parameter : wanted.groups[g]) {
          const auto found = source.find(name_in(where, parameter.name));
          if (found != source.end()) {
            copy_overlap({start, found->second.reshape({-1})}, low, high, slice);
            ++present;
          }
          start += numel_of(parameter.shape);
        }
        if (present == 0) continue;  // a kind the checkpoint lacks
        if (present != static_cast<int64_t>(wanted.groups[g].size())) {
          throw Error(directory + ": the checkpoint holds '" + kind + "' for some of group " + std::to_string(g) +
                      "'s parameters only");
        }
      }
      result.slices.emplace(slice_key(kind, g), std::move(slice));
    }
  }
  if (written && written->ranks == ranks) {
    const auto in_layout = [&](const std::string& key) {
      const auto dot = key.rfind('.');
      return dot != std::string::npos && written->kinds.count(key.substr(0, dot)) > 0;
    };
    for (const auto& [key, tensor] : shard_of_rank(rank)) {
      if (!in_layout(key)) result.own.emplace(key, tensor.clone());
    }
  }
  // What the slices came from is not the replicated part.
  for (const auto& [kind, where] : wanted.kinds) {
    auto& source = where.into_weights ? checkpoint.weights : checkpoint.state;
    for (const auto& group : wanted.groups) {
      for (const auto& parameter : group) source.erase(name_in(where, parameter.name));
    }
  }
  return result;
}

std::string checkpoint_config(const std::string& directory) {
  const auto path = fs::path(directory) / kConfigFile;
  if (!fs::exists(path)) throw Error(directory + ": incomplete checkpoint, " + kConfigFile + " is missing");
  return read_text(path);
}

Checkpoint load_checkpoint(const std::string& directory) {
  auto checkpoint = load_checkpoint_files(directory);
  if (const auto layout = checkpoint.state_metadata.find(kLayoutKey); layout != checkpoint.state_metadata.end()) {
    join_shards(fs::path(directory), parse_layout(fs::path(directory), layout->second), checkpoint);
    checkpoint.state_metadata.erase(layout);
  }
  fill_from_base(checkpoint, directory);
  return checkpoint;
}

TensorMap inference_weights(const Checkpoint& checkpoint) {
  auto weights = checkpoint.weights;
  for (auto& [name, tensor] : with_prefix_removed(checkpoint.state, "ema.")) weights[name] = std::move(tensor);
  return weights;
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

void write_checkpoint_files(const std::string& staging, Checkpoint checkpoint, const ShardLayout& layout) {
  const fs::path folder(staging);
  checkpoint.state_metadata[kLayoutKey] = layout_json(layout);
  write_file_atomic((folder / kConfigFile).string(), checkpoint.config_yaml);
  write_safetensors((folder / kWeightsFile).string(), checkpoint.weights);
  write_safetensors((folder / kStateFile).string(), checkpoint.state, checkpoint.state_metadata);
}

void write_checkpoint_shard(const std::string& staging, int64_t rank, int64_t ranks, const TensorMap& shard) {
  write_safetensors((fs::path(staging) / shard_file(rank, ranks)).string(), shard);
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
  std::optional<fs::path> previous;
  if (fs::exists(directory)) {
    previous = temporary_sibling(directory);
    fs::rename(directory, *previous);
  }
  fs::rename(staging_for(step), directory);
  if (previous) fs::remove_all(*previous);
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
