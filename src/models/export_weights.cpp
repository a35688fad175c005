#include "dalle/models/export_weights.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <string_view>
#include <unordered_set>
#include <utility>

#include <torch/torch.h>

#include "dalle/config.h"
#include "dalle/error.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/adapter.h"
#include "dalle/models/trained.h"

namespace dalle::models {

namespace fs = std::filesystem;

namespace {

// Whether a checkpoint's config describes the transformer prior (no `kind`, as OpenAI's
// imported dVAE has none either, but no prior key).
bool is_prior(const std::string& directory, const std::string& config_yaml) {
  const auto kind = peek_choice(ConfigSource::from_string(config_yaml, directory + "/config.yaml"), "kind", "",
                                {"dvae", "vqgan", "clip", "rrdbnet", "bart_prior"});
  return kind.empty() && config_yaml.find("text_vocab_size") != std::string::npos;
}

// Loads the checkpoint as the model its config describes, as the tools that read the export
// will: a config without sizes, NaN weights, or weights that do not fit the config are
// refused here rather than shipped.
void check_loadable(const std::string& directory, const std::string& config_yaml) {
  const auto kind = peek_choice(ConfigSource::from_string(config_yaml, directory + "/config.yaml"), "kind", "",
                                {"dvae", "vqgan", "clip", "rrdbnet", "bart_prior"});
  if (kind == "clip") {
    load_trained_clip(directory);
  } else if (kind == "rrdbnet") {
    load_trained_rrdbnet(directory);
  } else if (kind == "bart_prior") {
    load_trained_bart_prior(directory);
  } else if (is_prior(directory, config_yaml)) {
    load_trained_prior(directory);
  } else {
    load_image_tokenizer(directory);
  }
}

// What inference reads from a checkpoint: its moving average where it keeps one.
io::TensorMap inference_weights(io::Checkpoint& checkpoint, bool& moving_average) {
  moving_average = !io::with_prefix_removed(checkpoint.state, "ema.").empty();
  return io::inference_weights(checkpoint);
}

AdapterConfig adapter_config(const ConfigSource& config) {
  AdapterConfig adapter;
  bind_config_parts(config, [&](ConfigVisitor& v) { v.section("adapter", "", adapter); });
  return adapter;
}

// The model a checkpoint holds: its inference weights with a run's adapters folded into the
// layers they adapt (`folded`: how many), each checkpoint its own before any averaging (the
// mean of B A is not the product of the means).
io::TensorMap model_weights(io::Checkpoint& checkpoint, const std::string& directory, bool& moving_average,
                            int64_t& folded) {
  auto weights = inference_weights(checkpoint, moving_average);
  const auto adapters = adapter_tensors(weights);
  folded = static_cast<int64_t>(adapters.size() / 2);
  if (adapters.empty()) return weights;
  const auto config = ConfigSource::from_string(checkpoint.config_yaml, directory + "/config.yaml");
  const auto scale = adapter_config(config).scale_of_adapters_in(directory);
  return merge_adapter_tensors(std::move(weights), adapters, scale, 1.0, directory);
}

// The run's newest `count` checkpoint directories, oldest first.
std::vector<std::string> newest_checkpoints(const std::string& run, int64_t count) {
  if (fs::exists(fs::path(run) / io::kWeightsFile)) {
    throw Error(run + ": averaging " + std::to_string(count) +
                " checkpoints needs the run directory, not one checkpoint");
  }
  const io::CheckpointStore store((fs::path(run) / io::kCheckpointsFolder).string());
  const auto steps = store.steps();
  if (static_cast<int64_t>(steps.size()) < count) {
    throw Error(run + ": has " + std::to_string(steps.size()) + " checkpoints, fewer than the " +
                std::to_string(count) + " to average (run.keep_checkpoints keeps that many)");
  }
  std::vector<std::string> directories;
  for (auto step = steps.end() - count; step != steps.end(); ++step) directories.push_back(store.directory_for(*step));
  return directories;
}

// Adds `other`'s floating-point tensors into `sum` (float64), refusing any name or shape
// that differs: checkpoints of different models must not be blended.
void accumulate(io::TensorMap& sum, const io::TensorMap& other, const std::string& where) {
  if (other.size() != sum.size()) {
    throw Error(where + ": has " + std::to_string(other.size()) + " tensors where the newest checkpoint has " +
                std::to_string(sum.size()) + "; only checkpoints of one model are averaged");
  }
  for (auto& [name, total] : sum) {
    const auto found = other.find(name);
    if (found == other.end() || !found->second.sizes().equals(total.sizes())) {
      throw Error(where + ": tensor " + name + " is missing or has another shape than in the newest checkpoint");
    }
    if (total.is_floating_point()) total.add_(found->second.to(torch::kFloat64));
  }
}

// An older checkpoint must hold the same kind of weights as the newest (moving average or
// weights), or the mean would blend two different things.
void check_like_newest(const std::string& directory, bool moving_average, bool newest_is_moving_average) {
  if (moving_average != newest_is_moving_average) {
    throw Error(directory + ": " + (moving_average ? "keeps" : "keeps no") +
                " moving average of the weights, unlike the newest checkpoint; only like checkpoints are averaged");
  }
}

// The mean of `newest` and `older` (each read in turn; sums in float64, each tensor cast back
// to the newest's type; integer tensors are the newest's).
io::TensorMap mean(io::TensorMap newest, size_t count, const std::function<void(io::TensorMap& sum)>& add_older) {
  std::map<std::string, torch::ScalarType> types;
  for (auto& [name, tensor] : newest) {
    types[name] = tensor.scalar_type();
    if (tensor.is_floating_point()) tensor = tensor.to(torch::kFloat64);
  }
  add_older(newest);
  for (auto& [name, tensor] : newest) {
    if (tensor.is_floating_point()) tensor = tensor.div(static_cast<double>(count)).to(types[name]);
  }
  return newest;
}

// `newest` is the last of `directories`' inference weights.
io::TensorMap averaged_weights(const std::vector<std::string>& directories, io::TensorMap newest,
                               bool newest_is_moving_average) {
  return mean(std::move(newest), directories.size(), [&](io::TensorMap& sum) {
    for (size_t i = 0; i + 1 < directories.size(); ++i) {
      auto checkpoint = io::load_inference_checkpoint(directories[i]);
      bool moving_average = false;
      int64_t folded = 0;
      auto weights = model_weights(checkpoint, directories[i], moving_average, folded);
      check_like_newest(directories[i], moving_average, newest_is_moving_average);
      accumulate(sum, weights, directories[i]);
    }
  });
}

// The config written with the export: `overrides` applied (the exported config is complete, so
// a key it lacks is a typo, not an addition), and no adapters where they were folded in.
std::string exported_config(const std::string& config_yaml, const std::string& directory,
                            const std::vector<std::string>& overrides, bool adapters_folded) {
  if (overrides.empty() && !adapters_folded) return config_yaml;
  auto config = ConfigSource::from_string(config_yaml, directory + "/config.yaml");
  for (const auto& assignment : overrides) config.replace(assignment);
  if (adapters_folded) config.replace("adapter.rank=0");
  return config.yaml();
}

// The sharded priors of `directories` (the newest last), each left unread but for what is
// kept whole (a fine-tuning run's base's shards beneath its own); none when one of them is not
// a sharded prior that can be read one block at a time (ruDALL-E's names, no shards).
std::vector<TrainedPriorWeights> sharded_priors(const std::vector<std::string>& directories) {
  std::vector<TrainedPriorWeights> priors;
  for (auto directory = directories.rbegin(); directory != directories.rend(); ++directory) {
    priors.insert(priors.begin(), read_trained_prior_weights(*directory));
    if (priors.front().unread.empty()) return {};
    check_like_newest(*directory, priors.front().moving_average, priors.back().moving_average);
  }
  return priors;
}

// The resblock a weight belongs to ("resblocks.<b>."), or the number of blocks for the rest.
size_t block_of(const std::string& name, size_t blocks) {
  constexpr std::string_view prefix = "resblocks.";
  if (!name.starts_with(prefix)) return blocks;
  const auto dot = name.find('.', prefix.size());
  try {
    return std::stoul(name.substr(prefix.size(), dot - prefix.size()));
  } catch (const std::exception&) {
    return blocks;
  }
}

// A sharded run's prior (no base, no adapters), or the mean of several checkpoints' (the
// newest last): each resblock joined from the shards (and averaged), checked by loading it into
// its block of a prior built one block at a time, written, and emptied before the next; then
// the embeddings and head. The export never holds the model whole (DALL-E 12B: 46 GiB in
// fp32), only the ends and one block (one per checkpoint averaged). The weights keep the dtype
// the newest stored them in.
int64_t export_sharded_prior(const std::string& out, const std::string& config_yaml,
                             const std::vector<TrainedPriorWeights>& sources) {
  const auto& newest = sources.back();
  auto specs = newest.unread.specs();
  for (const auto& [name, tensor] : newest.weights) specs.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  const auto blocks = static_cast<size_t>(2 * newest.config.layers);
  // In the order they are read: block by block, each block's names in order, then the rest.
  std::sort(specs.begin(), specs.end(), [&](const io::TensorSpec& a, const io::TensorSpec& b) {
    return std::pair(block_of(a.name, blocks), a.name) < std::pair(block_of(b.name, blocks), b.name);
  });
  std::map<std::string, torch::ScalarType> stored;
  for (const auto& spec : specs) stored[spec.name] = spec.dtype;
  const auto read_mean = [&sources, &newest](const WeightPicker& wanted) {
    return mean(newest.read(wanted), sources.size(), [&](io::TensorMap& sum) {
      for (size_t i = 0; i + 1 < sources.size(); ++i) accumulate(sum, sources[i].read(wanted), sources[i].source);
    });
  };
  io::save_checkpoint(out, config_yaml, specs, [&](io::SafetensorsWriter& writer) {
    const auto write = [&](const io::TensorMap& tensors, const std::string& prefix) {
      for (const auto& [name, tensor] : tensors) writer.write(prefix + name, tensor.to(stored.at(prefix + name)));
    };
    std::unordered_set<std::string> in_blocks;
    const auto built = [&](size_t b, ResblockImpl& block) {
      const auto prefix = "resblocks." + std::to_string(b) + ".";
      auto values = io::state_dict(block);
      write(values, prefix);
      for (auto& [name, tensor] : values) {
        in_blocks.insert(prefix + name);
        tensor.set_data(torch::empty({0}, tensor.options()));
      }
    };
    const auto prior = build_trained_prior(newest.config, read_mean, newest.source, built);
    auto ends = io::state_dict(*prior);
    std::erase_if(ends, [&](const auto& item) { return in_blocks.count(item.first) > 0; });
    write(ends, "");
  });
  return static_cast<int64_t>(specs.size());
}

}  // namespace

ExportedWeights export_weights(const std::string& run_or_checkpoint, const std::string& out,
                               const std::vector<std::string>& config_overrides, int64_t average_last) {
  if (average_last < 1) throw Error("the number of checkpoints to average must be at least 1");
  ExportedWeights exported;
  if (average_last > 1) {
    exported.averaged = newest_checkpoints(run_or_checkpoint, average_last);
    exported.checkpoint = exported.averaged.back();
  } else {
    exported.checkpoint = io::resolve_checkpoint(run_or_checkpoint, "trained model");
    exported.averaged = {exported.checkpoint};
  }
  // Only an empty folder or an earlier export may be replaced, never a run or the source.
  if (fs::exists(out) && !fs::is_empty(out) && !fs::exists(fs::path(out) / io::kWeightsFile)) {
    throw Error(out + ": exists and is not a checkpoint directory; choose another output folder");
  }
  for (const auto& source : exported.averaged) {
    if (fs::exists(out) && fs::equivalent(out, source)) {
      throw Error(out + ": is a checkpoint being exported; choose another output folder");
    }
  }
  // A sharded prior's shards (and a sharded base's) are read one group at a time.
  const auto config_yaml = io::checkpoint_config(exported.checkpoint);
  const auto sharded = is_prior(exported.checkpoint, config_yaml) ? sharded_priors(exported.averaged)
                                                                  : std::vector<TrainedPriorWeights>{};
  if (!sharded.empty()) {
    const auto& newest = sharded.back();
    exported.moving_average = newest.moving_average;
    exported.merged_adapters = static_cast<int64_t>(newest.adapters.size() / 2);
    exported.streamed = true;
    exported.tensors = export_sharded_prior(
        out, exported_config(config_yaml, exported.checkpoint, config_overrides, !newest.adapters.empty()), sharded);
    return exported;
  }
  auto checkpoint = io::load_inference_checkpoint(exported.checkpoint);
  check_loadable(exported.checkpoint, checkpoint.config_yaml);
  // A run that trained adapters exports the model they make: folded in, no adapter left.
  auto weights = model_weights(checkpoint, exported.checkpoint, exported.moving_average, exported.merged_adapters);
  if (exported.averaged.size() > 1) {
    weights = averaged_weights(exported.averaged, std::move(weights), exported.moving_average);
  }
  io::Checkpoint weights_only{exported_config(checkpoint.config_yaml, exported.checkpoint, config_overrides,
                                              exported.merged_adapters > 0),
                              std::move(weights), {}, {}};
  exported.tensors = static_cast<int64_t>(weights_only.weights.size());
  io::save_checkpoint(out, weights_only);
  return exported;
}

}  // namespace dalle::models

namespace dalle::models {

ExportedAdapter export_adapter(const std::string& run_or_checkpoint, const std::string& out) {
  ExportedAdapter exported;
  exported.checkpoint = io::resolve_checkpoint(run_or_checkpoint, "fine-tuning run");
  auto checkpoint = io::load_inference_checkpoint(exported.checkpoint);
  const auto config = ConfigSource::from_string(checkpoint.config_yaml, exported.checkpoint + "/config.yaml");
  const auto adapter = adapter_config(config);
  bool moving_average = false;
  const auto adapters = adapter_tensors(inference_weights(checkpoint, moving_average));
  if (adapters.empty() || !adapter.enabled()) {
    throw Error(exported.checkpoint + ": trained no adapters (its config's adapter.rank is 0); export the whole "
                "model without --adapter");
  }
  // The model the run started from, as its recipe named it (not the run's own copy of its
  // frozen weights, RUN/base), resolved to its checkpoint while it is there.
  std::string started_from;
  bind_config_parts(config, [&](ConfigVisitor& v) {
    v.field("init_from", started_from, "");
    v.field("init", started_from, "");
  });
  exported.base = started_from.empty() ? io::base_of(checkpoint) : started_from;
  try {
    if (!started_from.empty()) {
      exported.base = fs::absolute(io::resolve_checkpoint(started_from, "base")).lexically_normal().string();
    }
  } catch (const Error&) {
    // Moved since the run started: the file keeps the name the recipe gave it.
  }
  const auto family = peek_choice(config, "kind", "prior", {"prior", "bart_prior"});
  save_adapter_file(out, adapters, adapter, exported.base, family);
  exported.layers = static_cast<int64_t>(adapters.size() / 2);
  return exported;
}

}  // namespace dalle::models
