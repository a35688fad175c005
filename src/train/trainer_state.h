#pragma once
// The trainer driver: what every trainer holds and does alike. A trainer's State derives
// from TrainerState<Config, Model> and fills it with its model (built on the CPU, so that a
// seed gives the same weights anywhere), its loss, its data and whatever extra state it
// checkpoints; the driver builds the moving average, AdamW, the precision and the update
// step, opens the run directory, writes and restores checkpoints (refusing a resume under a
// changed config) and adds the fp16 scales to the metrics line. Its parts that need no
// template are files of their own: joining the job (train/trainer_job.h), a fine-tuning
// run's base (train/fine_tuning_base.h) and the metrics line (train/metrics_line.h).
// Private to the library.
#include <torch/optim/optimizer.h>
#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "dalle/data/loader.h"
#include "dalle/device.h"
#include "dalle/distributed/job.h"
#include "dalle/error.h"
#include "dalle/log.h"
#include "dalle/io/checkpoint.h"
#include "dalle/models/adapter.h"
#include "dalle/runtime.h"
#include "dalle/train/adamw.h"
#include "dalle/train/stop_request.h"
#include "dalle/train/trainable.h"
#include "dalle/train/ema.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/recipe.h"
#include "dalle/train/update_step.h"
#include "train/fine_tuning_base.h"
#include "train/metrics_line.h"
#include "train/run_directory.h"
#include "train/trainer_job.h"
#include "train/training_loop.h"

namespace dalle::train::detail {

// The start of every trainer: refuses a foreign `run` directory (`what` names the kind of
// run in the error), sets torch's threads and seed, then builds the State.
template <class State, class Config>
std::unique_ptr<State> start_trainer(Config config, const std::string& run, const std::string& what) {
  check_run_directory(run, what);
  prepare_torch(config.run.threads, config.run.seed);
  return std::make_unique<State>(std::move(config), std::filesystem::path(run));
}

template <class Config, class Model>
struct TrainerState : RunRecord {
  Config config;
  torch::Device device;
  std::shared_ptr<distributed::Job> job;
  Model model{nullptr}, ema_model{nullptr};
  std::unique_ptr<Ema> ema;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<ModelPrecision> precision;
  std::unique_ptr<UpdateStep> update;

  // `what` names the trainer in logs and errors ("prior"); only a trainer that `can_shard`
  // accepts distributed.sharding other than none.
  TrainerState(const std::string& what, Config c, std::filesystem::path run, bool can_shard = false,
               const distributed::LaunchEnvironment& place = distributed::read_launch_environment())
      : RunRecord(what, std::move(run), c.run.keep_checkpoints),
        config(std::move(c)),
        device(rank_device(resolve_device(config.run.device, what + " training"), place)),
        job(join_job(config, place, device)) {
    if (config.distributed.sharding != "none" && !can_shard) {
      throw Error(what + " training: distributed.sharding " + config.distributed.sharding +
                  " is for the prior; train this model data-parallel (sharding: none)");
    }
    if (config.precision.weights != "float32" && !can_shard) {
      throw Error(what + " training: precision.weights " + config.precision.weights +
                  " is for the prior sharded within the machine; keep float32 here");
    }
    if (job->size() == 1) return;
    if (!job->is_main()) leave_files_to_another();
    should_stop = [this] { return job->any(stop_requested()); };
  }
  virtual ~TrainerState() = default;

  // This rank's examples: its shard of every epoch's order...
  data::SamplerOptions shard() const {
    return {.seed = static_cast<uint64_t>(config.run.seed), .rank = job->rank(), .world_size = job->size()};
  }
  // ...and its part of each global batch of `global` examples.
  int64_t rank_batch(int64_t global) const {
    if (global % job->size() != 0) {
      throw Error(what + ": data.batch_size " + std::to_string(global) + " does not divide between " +
                  std::to_string(job->size()) + " ranks; make it a multiple of the ranks");
    }
    return global / job->size();
  }
  // The data-parallel replicas, which multiply the fp16 gradient scales.
  int64_t replicas() const { return job->size(); }

  // The checkpoint the run started from, when it holds every frozen parameter under its name:
  // checkpoints then keep only what trains and refer to it for the rest (io::refer_to_base).
  std::string base_checkpoint;

  // Once `model` is built: adds the recipe's adapters, moves it to the device and freezes what
  // optimizer.trainable (and adapters) leave out; unless `sharded`, makes the validation copy
  // and starts the moving average of what trains. A sharded model (the prior, its resblocks
  // cut into shards as they were built) has no validation copy, starts its average once cut
  // and says what trains from its shards.
  void place_model(bool sharded = false) {
    add_adapters_to(*model);
    model->to(device);
    const auto trained = freeze_all_but(*model, trainable_patterns(config.optimizer.trainable, adapters()), what);
    if (!sharded) {
      ema_model = Model(config.model);
      add_adapters_to(*ema_model);
      ema_model->to(device);
      start_average();
    }
    if (sharded || frozen_names().empty()) return;
    int64_t trained_values = 0, all_values = 0;
    for (const auto& parameter : model->parameters()) {
      all_values += parameter.numel();
      trained_values += parameter.requires_grad() ? parameter.numel() : 0;
    }
    log::info(what, ": ", trained, " of ", model->parameters().size(), " parameter tensors train (",
              trained_values, " values, ", 100.0 * static_cast<double>(trained_values) / static_cast<double>(all_values),
              "% of the model); the rest is frozen");
  }

  // The moving average of what trains. Frozen weights are not averaged: the validation copy,
  // if any, shares them with the model.
  void start_average() {
    ema = std::make_unique<Ema>(*model, config.optimizer.ema_decay);
    const auto frozen = frozen_names();
    ema->forget(frozen);
    if (!ema_model || frozen.empty()) return;
    auto ema_parameters = ema_model->named_parameters();
    for (const auto& item : model->named_parameters()) {
      if (!item.value().requires_grad()) ema_parameters[item.key()].set_data(item.value());
    }
  }

  models::AdapterConfig adapters() const {
    if constexpr (requires(const Config& c) { c.adapter; }) return config.adapter;
    return {};
  }
  void add_adapters_to(torch::nn::Module& target) const { models::add_adapters(target, adapters(), torch::kFloat32); }

  // The names of the model's parameters that do not train.
  std::vector<std::string> frozen_names() const {
    std::vector<std::string> names;
    for (const auto& item : model->named_parameters()) {
      if (!item.value().requires_grad()) names.push_back(item.key());
    }
    return names;
  }

  // A run started from `init_from` (a run or checkpoint) with frozen parameters: its
  // checkpoints keep only what trains and refer to a base for the rest. The base is that
  // checkpoint when its inference weights hold every frozen parameter under its name with the
  // value the model holds; else (an imported model under its family's own names, a run whose
  // adapters were folded in on loading) a copy of the frozen weights as the model holds them,
  // written once into the run (`base/`) with its first checkpoint. `as_read`: the frozen values
  // the model no longer holds whole (a prior built sharded: its blocks as they were read),
  // read and compared one block at a time.
  void refer_to_base(const std::string& init_from, const ValuesAsRead& as_read = nullptr) {
    const auto frozen = frozen_names();
    if (init_from.empty() || frozen.empty()) return;
    const auto base = io::resolve_checkpoint(init_from, what + " init_from");
    if (train::holds_as_they_are(base, model->named_parameters(), frozen, as_read)) {
      return refer_to_base_as_read(init_from);
    }
    base_checkpoint = (run / "base").string();
    write_base_copy_ = true;
    log::info(what, ": ", base, " does not hold the frozen weights as the model does; checkpoints refer to a copy "
              "of them under the model's names, ", base_checkpoint, ", written with the first checkpoint");
  }
  // refer_to_base for a model whose frozen weights are `init_from`'s as it stores them (a
  // sharded checkpoint read block by block, never whole): that checkpoint is the base.
  void refer_to_base_as_read(const std::string& init_from) {
    if (init_from.empty() || frozen_names().empty()) return;
    base_checkpoint = io::resolve_checkpoint(init_from, what + " init_from");
    log::info(what, ": checkpoints hold what trains and refer to ", base_checkpoint, " for the frozen weights");
  }
  // The frozen weights as the model holds them, as the checkpoint `base_checkpoint` names;
  // `released`: those the model does not hold whole (a sharded run's frozen blocks).
  void write_base_copy(const io::TensorMap& released = {}) {
    write_base_copy_ = false;
    if (writes_files) write_frozen_copy(base_checkpoint, model->named_parameters(), frozen_names(), released);
  }
  bool write_base_copy_ = false;

  // AdamW over `groups` with the recipe's optimizer section (a group with options of its own
  // keeps its weight decay), its moments in the recipe's precision.
  std::unique_ptr<AdamW> make_adamw(std::vector<torch::optim::OptimizerParamGroup> groups,
                                    double first_learning_rate) const {
    const auto& o = config.optimizer;
    auto adamw = std::make_unique<AdamW>(std::move(groups),
                                         torch::optim::AdamWOptions(first_learning_rate)
                                             .betas({o.beta1, o.beta2})
                                             .eps(o.epsilon)
                                             .weight_decay(o.weight_decay),
                                         config.precision.moments_dtype());
    for (auto& group : adamw->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).betas({o.beta1, o.beta2}).eps(o.epsilon);
    }
    return adamw;
  }

  // AdamW over `groups`, `precision` and the update step, with `options`' name and
  // clipping filled in from the recipe.
  // Frozen parameters (optimizer.trainable) are left out of the groups.
  void build_update(std::vector<torch::optim::OptimizerParamGroup> groups, double first_learning_rate,
                    std::unique_ptr<ModelPrecision> model_precision, UpdateOptions options = {}) {
    std::vector<torch::optim::OptimizerParamGroup> trained;
    for (auto& group : groups) {
      auto parameters = trained_only(group.params());
      if (parameters.empty()) continue;
      trained.emplace_back(std::move(parameters),
                           group.has_options() ? group.options().clone() : nullptr);
    }
    optimizer = make_adamw(std::move(trained), first_learning_rate);
    precision = std::move(model_precision);
    options.what = what;
    options.grad_clip = config.optimizer.grad_clip;
    update = std::make_unique<UpdateStep>(*optimizer, *precision, std::move(options), ema.get(), model.get());
    update->set_reducer(job->reducer());
  }
  // The usual case: every learned tensor in one group with the config's weight decay, one
  // fp16 scale on the loss.
  void build_update(const std::vector<torch::Tensor>& learned, double first_learning_rate, UpdateOptions options = {}) {
    build_update({torch::optim::OptimizerParamGroup(learned)}, first_learning_rate,
                 std::make_unique<ModelPrecision>(config.precision, learned, replicas()), std::move(options));
  }

  // Sets every parameter group's learning rate for the coming update.
  void set_learning_rate(double rate) {
    for (auto& group : optimizer->param_groups()) group.options().set_lr(rate);
  }

  // One update with `loss`. A loss that is not finite ends the run before the weights, the
  // average or a checkpoint take it; `terms`, when given, describes its parts in that message.
  UpdateResult apply_update(const torch::Tensor& loss, const std::function<std::string()>& terms = nullptr) {
    if (!torch::isfinite(loss).item<bool>()) {
      throw Error(what + ": the loss is not finite at update " + std::to_string(step + 1) +
                  (terms ? " (" + terms() + ")" : "") + "; lower the learning rate or resume from an earlier checkpoint");
    }
    return update->apply(loss, step + 1);
  }

  // Locks the run directory and resumes from its latest checkpoint, if any.
  void open_run(bool samples) {
    open(visit_of(config), samples, [this](const std::string& latest) { resume(latest); });
    traffic_.step = step;
    job->check_same(step, "the update to start from (every rank must see the run directory " + run.string() +
                              ", on a file system they share)");
  }

  virtual void save_checkpoint() {
    auto checkpoint =
        make_checkpoint(config_to_yaml(visit_of(config)), *model, *ema, *optimizer, step, loader_position());
    if (!base_checkpoint.empty() && writes_files) {
      if (write_base_copy_) write_base_copy();
      for (const auto& name : frozen_names()) checkpoint.weights.erase(name);
    }
    add_run_state(checkpoint);
    save(checkpoint);
  }
  // What every checkpoint holds beside the weights, their average and the moments: the fp16
  // scales, the reducer's state, the base it refers to and the trainer's own state.
  void add_run_state(io::Checkpoint& checkpoint) const {
    precision->save_state(checkpoint.state, "gradient_scaler.");
    update->reducer().save_state(checkpoint.state, "reducer.");
    if (!base_checkpoint.empty() && writes_files) io::refer_to_base(checkpoint, base_checkpoint);
    save_extra(checkpoint);
  }

  virtual void resume(const std::string& directory) {
    auto checkpoint = io::load_checkpoint(directory);
    base_checkpoint = io::base_of(checkpoint);
    check_resumable<Config>(config, checkpoint.config_yaml, directory + "/config.yaml",
                            [this](const std::string& key) { return may_change_on_resume(key); });
    finish_resume(checkpoint, directory, restore_checkpoint(checkpoint, directory, *model, *ema, *optimizer));
  }
  // What every resume ends with once the weights, their average and the moments are back: the
  // thread count, the fp16 scales, the reducer's state, the trainer's own state and the
  // loader's place.
  void finish_resume(const io::Checkpoint& checkpoint, const std::string& directory,
                     const RestoredProgress& progress) {
    keep_threads_of(checkpoint);
    precision->load_state(checkpoint.state, "gradient_scaler.");
    update->reducer().load_state(checkpoint.state, "reducer.");
    restore_extra(checkpoint, directory);
    seek_loader(progress.position);
    resumed(directory, progress.step);
  }

  // With run.threads 0, a resumed run computes with the thread count its checkpoint was
  // written with, not with what the machine's load suggests now: CPU results depend on it
  // in their last bits, and a resume must continue exactly.
  void keep_threads_of(const io::Checkpoint& checkpoint) const {
    const auto saved = checkpoint.state_metadata.find("torch_threads");
    if (config.run.threads != 0 || saved == checkpoint.state_metadata.end()) return;
    const int threads = std::stoi(saved->second);
    if (threads != at::get_num_threads()) {
      log::info(what, ": ", threads, " torch threads, as when the checkpoint was written (run.threads sets others)");
      at::set_num_threads(threads);
    }
  }

  // A metrics line with the fp16 scales added: the one scale, or the spread of the
  // per-resblock ones, and the updates skipped so far. In a job, every rank calls it after
  // the same update: its fractional values (losses, ...) become the mean over the ranks.
  void append_metrics(nlohmann::json line) const {
    add_traffic(line);
    add_update_time(line);
    average_over_job(line, *job);
    add_scale_metrics(line, *precision);
    metrics_log.append(line);
  }

  // In a job on several machines: the megabytes per update each rank sent to collectives
  // that cross machines (gradient reduction), since the last line (averaged over the ranks
  // with the line's other values).
  void add_traffic(nlohmann::json& line) const {
    if (job->place().nodes == 1 || step <= traffic_.step) return;
    const int64_t bytes = update->reducer().bytes_across_machines();
    line["across_machines_mb"] =
        static_cast<double>(bytes - traffic_.bytes) / 1e6 / static_cast<double>(step - traffic_.step);
    traffic_ = {step, bytes};
  }
  // The mean wall time of the updates since the last line (every rank times the same
  // updates, so the line's average over the ranks is theirs).
  void add_update_time(nlohmann::json& line) const {
    if (updates_timed == 0) return;
    line["update_seconds"] = update_seconds / static_cast<double>(updates_timed);
    update_seconds = 0;
    updates_timed = 0;
  }
  struct Traffic {
    int64_t step = 0, bytes = 0;
  };
  mutable Traffic traffic_;  // at the last metrics line (or the start)

  // What differs between trainers.
  virtual data::LoaderPosition loader_position() const = 0;
  virtual void seek_loader(const data::LoaderPosition& position) = 0;
  // Keys beyond the run controls that a resume may change (sample settings, ...).
  virtual bool may_change_on_resume(const std::string& key) const { return is_run_control_key(key); }
  virtual void save_extra(io::Checkpoint&) const {}
  virtual void restore_extra(const io::Checkpoint&, const std::string& directory) { (void)directory; }
};

}  // namespace dalle::train::detail
