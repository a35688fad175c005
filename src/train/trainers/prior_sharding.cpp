// The sharded prior (distributed.sharding within_node): built one block at a time or cut
// once loaded, its update moved to the shards, resumed from this rank's slices and written
// in shards.
#include "train/trainers/prior_trainer_state.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <torch/torch.h>

#include <functional>
#include <map>
#include <numeric>
#include <unordered_set>

#include "dalle/distributed/sharded_parameters.h"
#include "dalle/distributed/sharded_reducer.h"
#include "dalle/io/state_dict.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/sharded_checkpoint.h"
#include "dalle/log.h"
#include "dalle/train/adamw.h"
#include "dalle/train/ema.h"
#include "dalle/train/optimizer_state.h"
#include "dalle/train/precision.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/resblock_runner.h"
#include "dalle/train/sharded_prior.h"
#include "dalle/train/stochastic_rounding.h"
#include "dalle/train/trainable.h"
#include "dalle/train/update_step.h"
#include "train/run_directory.h"
#include "train/trainers/trainer_support.h"

namespace dalle::train {

using namespace prior_training;

// A sharded run builds the prior one block at a time, each drawn, or read from init_from's
// weights (`init`), frozen where the recipe freezes it (its frozen matrices rounded to
// frozen_weights) and cut into its shards on the run's device before the next exists: no
// rank ever holds the whole prior, and the weights are those of a whole build, or of
// init_from, bit for bit (its embeddings and head, built whole, are cut once placed; the
// adapters, drawn once the prior exists as for a whole build, stay whole).
void PriorTrainer::State::build_model(const models::TrainedPriorWeights* init) {
  if (!shards_resblocks()) {
    model = init ? models::build_trained_prior(config.model, *init) : models::Prior(config.model);
    model->train();
    return;
  }
  const auto frozen_storage = frozen_matrix_storage();
  const ShardedCollectives collectives{
      .overlap = config.distributed.overlap,
      .prefetch_before_gradients = config.distributed.backward_prefetch == "before_gradients"};
  shards = std::make_unique<ShardedPrior>(2 * static_cast<size_t>(config.model.layers), decayed_by_adamw,
                                          job->within_node(), collectives, models::is_adapter_tensor,
                                          config.precision.weights_dtype(), frozen_storage.value_or(torch::kFloat32));
  const auto trained = trainable_patterns(config.optimizer.trainable, adapters());
  const auto cut = [&](size_t b, models::ResblockImpl& block) {
    freeze_part_all_but(block, trained, "resblocks." + std::to_string(b) + ".");
    if (frozen_storage) store_frozen_matrices(block, "", *frozen_storage);
    block.to(device);
    shards->add_block(b, block);
  };
  model = init ? models::build_trained_prior(config.model, *init, cut) : models::Prior(config.model, cut);
  model->train();
#if defined(__GLIBC__)
  // Each block drawn whole and freed leaves holes in the C heap between the shards kept there
  // (glibc's dynamic mmap threshold puts them on the heap once large blocks have been freed):
  // about 200 MiB per rank resident at 8 layers of width 2048 that nothing holds. Returned.
  malloc_trim(0);
#endif
  const std::string read = init && !init->unread.empty() ? "read from init_from's shard files" : "read from init_from";
  log::info(what, ": the prior was built one resblock at a time, each ", init ? read : "drawn", " and cut into ",
            job->within_node()->size(), " shards before the next");
}

// Each rank of a machine keeps 1/N of every resblock, of the embeddings and of the head (of
// a frozen base too); the prior's own tensors are emptied. Adapters, small, stay whole. The
// blocks were cut as they were built: the ends are cut here, once the prior is placed.
void PriorTrainer::State::cut_into_shards() {
  if (!shards) return;
  shards->add_ends(*model);
  if (frozen_names().empty()) return;
  const auto& sharded = *shards->parameters();
  int64_t trained = 0, all = 0;
  for (size_t g = 0; g < sharded.groups(); ++g) {
    for (const auto& shape : sharded.shapes(g)) {
      const auto values = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
      all += values;
      trained += g < shards->trained_groups() ? values : 0;
    }
  }
  for (const auto& parameter : trained_only(model->parameters())) {
    trained += parameter.numel();
    all += parameter.numel();
  }
  const double percent = 100.0 * static_cast<double>(trained) / static_cast<double>(all);
  log::info(what, ": ", trained, " of ", all, " values train (", percent, "% of the model); the rest is frozen");
}

// The update state of a sharded prior, made once: AdamW over the shards and what trains whole
// (outside the blocks, and the adapters), a moving average of each shard (starting as the
// shard), per-resblock fp16 scales over each block's shards, and the update step with the
// sharded reducer.
void PriorTrainer::State::build_sharded_update() {
  const auto& sharded = *shards->parameters();
  const auto in_shards = block_names();
  std::unordered_set<const torch::TensorImpl*> sharded_tensors;
  for (const auto& item : model->named_parameters()) {
    if (in_shards.count(item.key())) sharded_tensors.insert(item.value().unsafeGetTensorImpl());
  }
  auto groups = parameter_groups(*model, config.optimizer.weight_decay, [&](const torch::Tensor& parameter) {
    return parameter.requires_grad() && sharded_tensors.count(parameter.unsafeGetTensorImpl()) == 0;
  });
  for (size_t g = 0; g < shards->trained_groups(); ++g) {
    ema->forget(shards->names(g));
    shard_averages.push_back(average_of(sharded.shard(g)));
  }
  for (const auto& shard : shards->decayed_shards()) groups[0].params().push_back(shard);
  for (const auto& shard : shards->undecayed_shards()) groups[1].params().push_back(shard);
  optimizer = make_adamw(std::move(groups), config.learning_rate.peak);
  // The replicas of a shard on other machines hold the same values: they round alike.
  optimizer->set_rounding_seed(mix_seed(static_cast<uint64_t>(config.run.seed),
                                        static_cast<uint64_t>(job->place().local_rank)));
  std::vector<torch::Tensor> learned;
  for (const auto& group : optimizer->param_groups()) {
    learned.insert(learned.end(), group.params().begin(), group.params().end());
  }
  precision = std::make_unique<ModelPrecision>(config.precision, learned, shards->scale_groups(), replicas());
  update = std::make_unique<UpdateStep>(*optimizer, *precision,
                                        UpdateOptions{.what = what,
                                                      .grad_clip = config.optimizer.grad_clip,
                                                      .measure_norm = true,
                                                      .after_step = [this] { average_shards(); }},
                                        ema.get(), model.get());
  // A job of one reduces its replicated parameters (adapters) over its group alone.
  const auto world = job->group() ? job->group() : job->within_node();
  sharded_reducer = std::make_shared<distributed::ShardedReducer>(
      shards->parameters(), world, job->within_node(), job->across_nodes(), bucket_bytes(config.distributed),
      powersgd_options(config.distributed, config.run), config.distributed.overlap, shards->uncompressed_groups());
  update->set_reducer(sharded_reducer);
  const int64_t ranks = job->place().local_world_size;
  if (ranks == 1 && job->place().nodes == 1) {
    log::info("prior: one rank holds the ", model->resblocks().size(), " resblocks, the embeddings and the head as "
              "shards of one, each gathered when it computes (", config.precision.weights, " matrices; the moving "
              "average swapped in block by block to validate, no whole copy)");
    return;
  }
  log::info("prior: the ", model->resblocks().size(), " resblocks, the embeddings and the head are sharded between the ",
            ranks, " ranks of each machine; each holds 1/", ranks, " of their weights, gradients and moments",
            frozen_names().empty() ? "" : " (of their frozen weights too; adapters stay whole)",
            job->place().nodes > 1 ? ", replicated on the " + std::to_string(job->place().nodes) + " machines" : "");
}

std::unordered_set<std::string> PriorTrainer::State::block_names() const {
  std::unordered_set<std::string> names;
  for (size_t g = 0; g < shards->parameters()->groups(); ++g) {
    names.insert(shards->names(g).begin(), shards->names(g).end());
  }
  return names;
}

// The resblocks' groups and the kinds of values a sharded checkpoint keeps of them.
io::ShardLayout PriorTrainer::State::shard_layout(bool moments, bool errors) const {
  const auto& sharded = *shards->parameters();
  io::ShardLayout layout{.ranks = job->place().local_world_size};
  layout.kinds = {{"weights", {.into_weights = true}}, {"ema", {.prefix = "ema."}}};
  if (errors) layout.kinds.insert({"powersgd_error", {.prefix = kReducerErrors}});
  if (moments) {
    layout.kinds.insert({{"exp_avg", {.prefix = "adamw.", .suffix = ".exp_avg"}},
                         {"exp_avg_sq", {.prefix = "adamw.", .suffix = ".exp_avg_sq"}}});
  }
  for (size_t g = 0; g < shards->trained_groups(); ++g) {
    const auto shapes = sharded.shapes(g);
    std::vector<io::ShardLayout::Parameter> parameters;
    for (size_t i = 0; i < shapes.size(); ++i) parameters.push_back({shards->names(g)[i], shapes[i]});
    layout.groups.push_back(std::move(parameters));
  }
  return layout;
}

// As TrainerState::resume, with the resblocks' weights, average, moments and PowerSGD error
// feedback read as this rank's slices (from the shard files that hold them, on any world
// size, or from a checkpoint that was not sharded). Each file's mapping is dropped once
// restored, so that a rank never holds more than its own state and one part of the rest.
void PriorTrainer::State::resume(const std::string& directory) {
  if (!shards) return TrainerState::resume(directory);
  check_resumable<PriorTrainConfig>(config, io::checkpoint_config(directory), directory + "/config.yaml",
                                    [this](const std::string& key) { return may_change_on_resume(key); });
  // Each group restored as soon as its slices are read: a rank never holds its state twice.
  auto read = io::load_checkpoint_for_rank(
      directory, shard_layout(true, true), job->place().local_rank, job->place().local_world_size,
      [this](size_t g, io::TensorMap& slices, const io::Checkpoint& replicated) {
        restore_group(g, slices, replicated.state);
      });
  log_shard_reads(read.shard_bytes_read);
  auto& checkpoint = read.replicated;
  base_checkpoint = io::base_of(checkpoint);
  shards->restore_frozen(checkpoint.weights, read.unread_base);
  if (!read.unread_base.empty()) {
    log::info(what, ": rank ", job->place().local_rank, " read its part of the frozen blocks from the base's shard "
              "files, one group at a time");
    read.unread_base = {};
  }
  io::load_state_dict(*model, checkpoint.weights, directory + "/" + io::kWeightsFile, block_names());
  checkpoint.weights.clear();
  ema->load(io::with_prefix_removed(checkpoint.state, "ema."));
  const auto moments = io::with_prefix_removed(checkpoint.state, "adamw.");
  load_adamw_state(*optimizer, *model, moments);
  restore_warm_q(read.own);
  finish_resume(checkpoint, directory, restore_progress(checkpoint));
}

// PowerSGD's warm Q of this rank's blocks of rows, from its own shard file: only a checkpoint
// written by as many ranks per machine has Q for the same blocks; any other starts afresh.
void PriorTrainer::State::restore_warm_q(const io::TensorMap& own) {
  if (config.distributed.gradient_reduction != "powersgd" || !config.distributed.powersgd.warm_start ||
      !job->across_nodes()) {
    return;
  }
  bool restored = false;
  for (size_t g = 0; g < shards->trained_groups(); ++g) {
    std::vector<torch::Tensor> qs;
    for (size_t k = 0;; ++k) {
      const auto found = own.find(kShardQ + std::to_string(g) + "." + std::to_string(k));
      if (found == own.end()) break;
      qs.push_back(found->second);
    }
    if (qs.empty()) continue;
    sharded_reducer->set_shard_q(g, qs);
    restored = true;
  }
  if (!restored) {
    log::warn(what, ": PowerSGD's warm Q starts afresh: the checkpoint holds none for this rank's blocks of rows "
                    "(written without warm_start, or by another number of ranks per machine)");
  }
}

void PriorTrainer::State::log_shard_reads(const std::map<int64_t, int64_t>& bytes_by_writer) const {
  int64_t bytes = 0;
  std::string writers;
  for (const auto& [writer, read] : bytes_by_writer) {
    bytes += read;
    writers += (writers.empty() ? "" : ", ") + std::to_string(writer);
  }
  const std::string files = bytes_by_writer.size() == 1 ? "the shard file of rank " : "the shard files of ranks ";
  log::info(what, ": rank ", job->place().local_rank, " of the machine read its part of the resblocks, ", bytes,
            " bytes, from ", writers.empty() ? std::string("the checkpoint's whole tensors") : files + writers);
}

// Group g's slices into its shard, its average, its AdamW state (with the step of the
// group's first parameter, from the replicated `state`) and PowerSGD's error feedback; each
// slice freed once used.
void PriorTrainer::State::restore_group(size_t g, io::TensorMap& slices, const io::TensorMap& state) {
  torch::NoGradGuard no_grad;
  const auto& sharded = *shards->parameters();
  const auto take = [&slices, g](const std::string& kind) {
    auto found = slices.find(kind + "." + std::to_string(g));
    if (found == slices.end()) return torch::Tensor();
    auto slice = std::move(found->second);
    slices.erase(found);
    return slice;
  };
  const auto weights = take("weights"), average = take("ema");
  if (!weights.defined() || !average.defined()) {
    throw Error("the checkpoint lacks resblock group " + std::to_string(g) + "'s weights or moving average");
  }
  sharded.shard(g).detach().copy_(weights);
  shard_averages[g].copy_(average);
  if (const auto error = take("powersgd_error"); error.defined()) sharded_reducer->set_shard_error(g, error);
  const auto exp_avg = take("exp_avg"), exp_avg_sq = take("exp_avg_sq");
  if (!exp_avg.defined() || !exp_avg_sq.defined() || shards->names(g).empty()) return;
  auto adam = std::make_unique<torch::optim::AdamWParamState>();
  adam->step(state.at("adamw." + shards->names(g).front() + ".step").item<int64_t>());
  const auto options = sharded.shard(g).options().dtype(optimizer->moments());
  adam->exp_avg(exp_avg.to(options));
  adam->exp_avg_sq(exp_avg_sq.to(options));
  optimizer->state()[sharded.shard(g).unsafeGetTensorImpl()] = std::move(adam);
}

void PriorTrainer::State::average_shards() {
  torch::NoGradGuard no_grad;
  const double weight = 1.0 - config.optimizer.ema_decay;
  for (size_t g = 0; g < shard_averages.size(); ++g) {
    auto& average = shard_averages[g];
    average.lerp_(shards->parameters()->shard(g).detach().to(average.device(), average.scalar_type()), weight);
  }
}

// A shard's moving average starts as the shard: float32 where the shard is, or, for a
// 16-bit shard, in host memory (precision.weights: the GPU keeps 16 bits per value, the
// average keeps the small steps that 16 bits would round away).
torch::Tensor PriorTrainer::State::average_of(const torch::Tensor& shard) const {
  if (shard.scalar_type() == torch::kFloat32) return shard.detach().clone();
  return shard.detach().to(torch::kCPU, torch::kFloat32);
}

models::Prior& PriorTrainer::State::validation_model() {
  if (shards) return model;
  ema->copy_to(*ema_model);
  return ema_model;
}

PriorTrainer::State::AverageSwappedIn::AverageSwappedIn(State& state) : state_(state) {
  if (!state_.shards) return;
  state_.ema->swap(*state_.model);
  state_.shards->gather_averages(state_.shard_averages);
  state_.model->set_resblock_runner(state_.validation_runner);
}

PriorTrainer::State::AverageSwappedIn::~AverageSwappedIn() {
  if (!state_.shards) return;
  state_.model->set_resblock_runner(state_.training_runner);
  state_.shards->gather_averages({});
  state_.ema->swap(*state_.model);
  state_.model->train();
}

void PriorTrainer::State::save_checkpoint() {
  if (!shards) return TrainerState::save_checkpoint();
  // Sharded: each rank of the first machine writes its shards of the resblocks, rank 0 the
  // rest (the replicated parameters, the state) and the shards' layout, into a staging folder
  // that rank 0 renames into place once every rank has written. load_checkpoint reads it whole,
  // so any number of ranks, sharded or not, resumes from it and dalle-export reads it.
  // Frozen blocks' weights are gathered (by every rank, one group at a time) only where no
  // base holds them, into rank 0's weights file, or to write the base's copy.
  if (write_base_copy_) write_sharded_base_copy();
  if (writes_files) checkpoints.stage(step);
  job->barrier();
  const auto staging = checkpoints.staging_for(step);
  // Moments exist once AdamW has stepped a trained shard (a group may be empty, or frozen).
  bool moments = false;
  for (size_t g = 0; g < shards->trained_groups(); ++g) {
    moments = moments || optimizer->state().count(shards->parameters()->shard(g).unsafeGetTensorImpl()) > 0;
  }
  // PowerSGD's error feedback, as its mean over the machines: every rank takes part.
  std::vector<torch::Tensor> errors;
  for (size_t g = 0; g < shards->trained_groups(); ++g) errors.push_back(sharded_reducer->shard_error(g));
  const bool has_errors = !errors.empty() && errors.front().defined();
  if (job->place().node_rank == 0) write_own_shards(staging, moments, errors);
  if (writes_files) {
    write_checkpoint_files(staging, moments, has_errors);
  } else if (base_checkpoint.empty()) {
    write_frozen_groups(nullptr);
  }
  job->barrier();
  if (writes_files) log::info(what, ": checkpoint ", checkpoints.publish(step));
}

// The run's copy of its frozen weights (the base its checkpoints refer to), gathered and
// written one group at a time: every rank gathers, rank 0 writes, and no rank holds them
// whole (DALL-E 12B's in bf16: 23 GiB).
void PriorTrainer::State::write_sharded_base_copy() {
  write_base_copy_ = false;
  const auto specs = shards->frozen_specs();
  std::unordered_set<std::string> in_shards;
  for (const auto& spec : specs) in_shards.insert(spec.name);
  for (const auto& name : frozen_names()) {
    if (!in_shards.count(name)) throw Error(what + ": the frozen " + name + " is in no shard; its copy cannot be made");
  }
  if (writes_files) {
    write_frozen_copy(base_checkpoint, specs, [this](io::SafetensorsWriter* writer) { write_frozen_groups(writer); });
  } else {
    write_frozen_groups(nullptr);
  }
}

// The frozen groups gathered one at a time (every rank of the machine takes part) and handed
// to `writer` in the order of frozen_specs(); none: gathered for another rank's writer.
void PriorTrainer::State::write_frozen_groups(io::SafetensorsWriter* writer) const {
  const auto specs = shards->frozen_specs();
  size_t next = 0;
  shards->each_frozen_group([&](const io::TensorMap& group) {
    for (const size_t end = next + group.size(); writer && next < end; ++next) {
      writer->write(specs[next].name, group.at(specs[next].name));
    }
  });
}

void PriorTrainer::State::write_own_shards(const std::string& staging, bool moments,
                                           const std::vector<torch::Tensor>& errors) const {
  const auto& sharded = *shards->parameters();
  io::TensorMap mine;
  for (size_t g = 0; g < shards->trained_groups(); ++g) {
    std::string index = ".";  // built up: GCC 12 misreads "." + std::to_string(g) at -O3
    index += std::to_string(g);
    mine.emplace("weights" + index, sharded.shard(g).detach().cpu());
    mine.emplace("ema" + index, shard_averages[g].cpu());
    if (errors[g].defined()) mine.emplace("powersgd_error" + index, errors[g].cpu());
    if (config.distributed.powersgd.warm_start) {
      const auto qs = sharded_reducer->shard_q(g);
      for (size_t k = 0; k < qs.size(); ++k) {
        mine.emplace(kShardQ + index.substr(1) + "." + std::to_string(k), qs[k].cpu());
      }
    }
    if (!moments) continue;
    // A group AdamW keeps no moments for (an empty one: the frozen ends of an adapter run): zeros.
    const auto state = optimizer->state().find(sharded.shard(g).unsafeGetTensorImpl());
    if (state == optimizer->state().end()) {
      mine.emplace("exp_avg" + index, torch::zeros({sharded.shard(g).numel()}));
      mine.emplace("exp_avg_sq" + index, torch::zeros({sharded.shard(g).numel()}));
      continue;
    }
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*state->second);
    mine.emplace("exp_avg" + index, adam.exp_avg().cpu());
    mine.emplace("exp_avg_sq" + index, adam.exp_avg_sq().cpu());
  }
  io::write_checkpoint_shard(staging, job->place().local_rank, job->place().local_world_size, mine);
}

// Rank 0's files; where the run has no base, the frozen blocks' weights streamed into them
// one group at a time (every rank gathers them with it: save_checkpoint).
void PriorTrainer::State::write_checkpoint_files(const std::string& staging, bool moments, bool errors) {
  const auto& sharded = *shards->parameters();
  const auto layout = shard_layout(moments, errors);
  auto weights = io::state_dict(*model);
  for (const auto& name : block_names()) weights.erase(name);
  if (!base_checkpoint.empty()) {
    for (const auto& name : frozen_names()) weights.erase(name);
  }
  auto replicated_moments = adamw_state(*optimizer, *model);
  for (size_t g = 0; moments && g < shards->trained_groups(); ++g) {
    for (const auto& name : shards->names(g)) {
      const auto& adam = static_cast<const torch::optim::AdamWParamState&>(
          *optimizer->state().at(sharded.shard(g).unsafeGetTensorImpl()));
      replicated_moments.emplace(name + ".step", torch::tensor(adam.step(), torch::kInt64));
    }
  }
  auto checkpoint = make_checkpoint(config_to_yaml(visit_of(config)), std::move(weights), ema->weights(),
                                    replicated_moments, step, loader_position());
  add_run_state(checkpoint);
  if (!base_checkpoint.empty()) return io::write_checkpoint_files(staging, std::move(checkpoint), layout);
  io::write_checkpoint_files(staging, std::move(checkpoint), layout, shards->frozen_specs(),
                             [this](io::SafetensorsWriter& writer) { write_frozen_groups(&writer); });
}

}  // namespace dalle::train
