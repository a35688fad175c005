#include "dalle/io/sharded_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dalle/error.h"
#include "io/checkpoint_files.h"

namespace dalle::io {
namespace fs = std::filesystem;

namespace {

constexpr const char* kLayoutKey = "shard_layout";

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

// Each rank's shard file of a checkpoint written by `ranks` ranks, mapped and unread.
std::vector<Safetensors> map_shard_files(const fs::path& directory, int64_t ranks) {
  std::vector<Safetensors> files;
  for (int64_t rank = 0; rank < ranks; ++rank) {
    const auto path = directory / shard_file(rank, ranks);
    if (!fs::exists(path)) {
      throw Error(directory.string() + ": incomplete checkpoint, " + path.filename().string() + " is missing");
    }
    files.push_back(read_safetensors(path.string()));
  }
  return files;
}

// Group g's values of `kind` as the shard files hold them, joined (a fresh tensor), each
// shard's pages released once read; `visit` takes each parameter's values, a view of them.
void join_group(const fs::path& directory, const std::vector<Safetensors>& files, const ShardLayout& layout,
                const std::string& kind, size_t g,
                const std::function<void(const ShardLayout::Parameter&, const torch::Tensor&)>& visit) {
  const std::string key = slice_key(kind, g);
  std::vector<torch::Tensor> parts;
  for (const auto& file : files) {
    const auto found = file.tensors.find(key);
    if (found == file.tensors.end()) throw Error(directory.string() + ": a shard lacks '" + key + "'");
    parts.push_back(found->second.reshape({-1}));
  }
  const auto flat = torch::cat(parts);
  for (const auto& file : files) release_pages(file.tensors.at(key));
  int64_t offset = 0;
  for (const auto& parameter : layout.groups[g]) {
    const int64_t numel = numel_of(parameter.shape);
    if (offset + numel > flat.numel()) throw Error(directory.string() + ": the shards of '" + key + "' are short");
    visit(parameter, flat.narrow(0, offset, numel).view(parameter.shape));
    offset += numel;
  }
}

// Joins the shards of `directory` into `checkpoint`, as `layout` lays them out (its kinds).
void join(const fs::path& directory, const ShardLayout& layout, Checkpoint& checkpoint) {
  const auto files = map_shard_files(directory, layout.ranks);
  for (const auto& [kind, where] : layout.kinds) {
    auto& target = where.into_weights ? checkpoint.weights : checkpoint.state;
    for (size_t g = 0; g < layout.groups.size(); ++g) {
      join_group(directory, files, layout, kind, g,
                 [&](const ShardLayout::Parameter& parameter, const torch::Tensor& values) {
                   target[name_in(where, parameter.name)] = values.clone();
                 });
    }
  }
}

// The kind of a sharded checkpoint's values that inference_weights reads: its moving average
// wherever it keeps one, else its weights.
std::string inference_kind(const ShardLayout& layout) { return layout.kinds.count("ema") ? "ema" : "weights"; }

}  // namespace

void detail::join_shards(const std::string& directory, Checkpoint& checkpoint, bool inference_only) {
  const auto layout = checkpoint.state_metadata.find(kLayoutKey);
  if (layout == checkpoint.state_metadata.end()) return;
  auto parsed = parse_layout(fs::path(directory), layout->second);
  if (inference_only) {
    const auto read = inference_kind(parsed);
    std::erase_if(parsed.kinds, [&](const auto& kind) { return kind.first != read; });
  }
  join(fs::path(directory), parsed, checkpoint);
  checkpoint.state_metadata.erase(layout);
}

ShardedWeights::ShardedWeights(std::string directory, ShardLayout layout)
    : directory_(std::move(directory)),
      layout_(std::move(layout)),
      kind_(inference_kind(layout_)),
      files_(std::make_shared<const std::vector<Safetensors>>(map_shard_files(directory_, layout_.ranks))) {}

std::vector<std::string> ShardedWeights::names() const {
  std::vector<std::string> names;
  for (const auto& group : layout_.groups) {
    for (const auto& parameter : group) names.push_back(parameter.name);
  }
  if (base_) {
    for (auto& name : base_->names()) {
      if (from_base(name)) names.push_back(std::move(name));
    }
  }
  return names;
}

bool ShardedWeights::from_base(const std::string& name) const { return !shadowed_.count(name); }

void ShardedWeights::rest_on(ShardedWeights base, const std::vector<std::string>& held) {
  if (base.empty()) return;
  shadowed_ = {held.begin(), held.end()};
  for (const auto& group : layout_.groups) {
    for (const auto& parameter : group) shadowed_.insert(parameter.name);
  }
  base_ = std::make_shared<const ShardedWeights>(std::move(base));
}

std::vector<TensorSpec> ShardedWeights::specs() const {
  std::vector<TensorSpec> specs;
  for (size_t g = 0; files_ && g < layout_.groups.size(); ++g) {
    const auto key = slice_key(kind_, g);
    const auto found = files_->front().tensors.find(key);
    if (found == files_->front().tensors.end()) throw Error(directory_ + ": a shard lacks '" + key + "'");
    for (const auto& parameter : layout_.groups[g]) {
      specs.push_back({parameter.name, found->second.scalar_type(), parameter.shape});
    }
  }
  if (base_) {
    for (auto& spec : base_->specs()) {
      if (from_base(spec.name)) specs.push_back(std::move(spec));
    }
  }
  return specs;
}

TensorMap ShardedWeights::read(const std::function<bool(const std::string&)>& wanted) const {
  TensorMap read;
  for (size_t g = 0; files_ && g < layout_.groups.size(); ++g) {
    const auto& group = layout_.groups[g];
    if (std::none_of(group.begin(), group.end(), [&](const auto& parameter) { return wanted(parameter.name); })) {
      continue;
    }
    join_group(directory_, *files_, layout_, kind_, g,
               [&](const ShardLayout::Parameter& parameter, const torch::Tensor& values) {
                 if (wanted(parameter.name)) read.emplace(parameter.name, values);
               });
  }
  if (base_) {
    read.merge(base_->read([&](const std::string& name) { return from_base(name) && wanted(name); }));
  }
  return read;
}

Checkpoint load_inference_checkpoint(const std::string& directory, ShardedWeights& unread) {
  auto checkpoint = detail::read_files(directory);
  unread = {};
  if (const auto layout = checkpoint.state_metadata.find(kLayoutKey); layout != checkpoint.state_metadata.end()) {
    unread = ShardedWeights(directory, parse_layout(fs::path(directory), layout->second));
    checkpoint.state_metadata.erase(layout);
  }
  // What the checkpoint holds, whole (its moving average included) or in its shards, hides
  // the base's values of it, shards or whole.
  std::vector<std::string> held;
  for (const auto& [name, tensor] : inference_weights(checkpoint)) held.push_back(name);
  ShardedWeights base;
  detail::fill_from_base(checkpoint, directory, &base);
  for (const auto& name : unread.names()) checkpoint.weights.erase(name);
  unread.rest_on(std::move(base), held);
  return checkpoint;
}

RankCheckpoint load_checkpoint_for_rank(const std::string& directory, const ShardLayout& wanted, int64_t rank,
                                        int64_t ranks, const TakeGroup& take) {
  const fs::path root(directory);
  RankCheckpoint result;
  result.replicated = detail::read_files(directory);
  auto& checkpoint = result.replicated;
  detail::fill_from_base(checkpoint, directory, &result.unread_base);
  std::optional<ShardLayout> written;
  if (const auto layout = checkpoint.state_metadata.find(kLayoutKey); layout != checkpoint.state_metadata.end()) {
    written = parse_layout(root, layout->second);
    checkpoint.state_metadata.erase(layout);
    // Groups beyond the written ones are read from the whole tensors (a checkpoint written
    // before the prior's embeddings and head were sharded keeps them whole).
    if (written->groups.size() > wanted.groups.size()) {
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
  for (size_t g = 0; g < wanted.groups.size(); ++g) {
    TensorMap group_slices;
    const bool in_shards = written && g < written->groups.size();
    for (const auto& [kind, where] : wanted.kinds) {
      if (in_shards && !written->kinds.count(kind)) continue;
      const int64_t values = values_of(wanted.groups[g]);
      const int64_t share = shard_size(values, ranks), low = rank * share, high = std::min(values, low + share);
      auto slice = torch::zeros({share});
      if (values == 0) {  // an empty group (a block whose matrices are all frozen)
        group_slices.emplace(slice_key(kind, g), std::move(slice));
        continue;
      }
      if (in_shards) {
        if (values_of(written->groups[g]) != values) {
          throw Error(directory + ": the checkpoint's shard group " + std::to_string(g) + " holds " +
                      std::to_string(values_of(written->groups[g])) + " values where the model has " +
                      std::to_string(values));
        }
        const int64_t written_share = shard_size(values, written->ranks);
        for (int64_t writer = low / written_share; writer < written->ranks && writer * written_share < high; ++writer) {
          const auto& shard = shard_of_rank(writer);
          const auto found = shard.find(slice_key(kind, g));
          if (found == shard.end()) throw Error(directory + ": a shard lacks '" + slice_key(kind, g) + "'");
          result.shard_bytes_read[writer] +=
              copy_overlap({writer * written_share, found->second.reshape({-1})}, low, high, slice);
          // Read once: its pages need not stay resident beside the slices until the end.
          release_pages(found->second);
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
      group_slices.emplace(slice_key(kind, g), std::move(slice));
    }
    if (take) {
      take(g, group_slices, checkpoint);
    } else {
      result.slices.merge(group_slices);
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

void write_checkpoint_files(const std::string& staging, Checkpoint checkpoint, const ShardLayout& layout,
                            const std::vector<TensorSpec>& streamed,
                            const std::function<void(SafetensorsWriter&)>& write) {
  checkpoint.state_metadata[kLayoutKey] = layout_json(layout);
  detail::write_files(staging, checkpoint, streamed, write);
}

void write_checkpoint_shard(const std::string& staging, int64_t rank, int64_t ranks, const TensorMap& shard) {
  write_safetensors((fs::path(staging) / shard_file(rank, ranks)).string(), shard);
}

}  // namespace dalle::io
