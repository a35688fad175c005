#include "dalle/train/trainers/prior_trainer.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <map>
#include <unordered_set>

#include "dalle/data/image.h"
#include "dalle/data/image_grid.h"
#include "dalle/data/loader.h"
#include "dalle/data/token_dataset.h"
#include "dalle/distributed/sharded_parameters.h"
#include "dalle/distributed/sharded_reducer.h"
#include "dalle/io/state_dict.h"
#include "dalle/device.h"
#include "dalle/io/atomic_file.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/sharded_checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/log.h"
#include "dalle/text/tokenizer.h"
#include "dalle/train/adamw.h"
#include "dalle/train/ema.h"
#include "dalle/train/gradient_scaler.h"
#include "dalle/models/trained.h"
#include "dalle/train/optimizer_state.h"
#include "dalle/train/precision.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/resblock_runner.h"
#include "dalle/train/sharded_resblocks.h"
#include "dalle/train/stochastic_rounding.h"
#include "dalle/train/update_step.h"
#include "train/run_directory.h"
#include "train/trainers/trainer_support.h"
#include "train/training_loop.h"

namespace dalle::train {
namespace fs = std::filesystem;
using torch::indexing::Slice;

void PriorLearningRate::visit(ConfigVisitor& v) {
  v.field("peak", peak, "learning rate reached after the warmup (DALL-E: 4.5e-4)", {.min = 0.0, .max = 1.0});
  v.field("warmup_steps", warmup_steps, "updates of linear warmup from 0 (DALL-E: 5000)", {.min = 0});
  v.field("decay", decay, "after the warmup: cosine down to `end` at the last update, or plateau halving (DALL-E)",
          {.choices = {"cosine", "plateau"}});
  v.field("end", end, "cosine: the learning rate at the last update", {.min = 0.0, .max = 1.0});
  v.field("plateau_factor", plateau_factor, "plateau: factor applied at each reduction (DALL-E: 0.5)",
          {.min = 0.0, .max = 1.0});
  v.field("plateau_patience", plateau_patience,
          "plateau: validations without a better validation loss before a reduction", {.min = 1});
  v.field("plateau_reductions", plateau_reductions, "plateau: the most reductions (DALL-E: 5)", {.min = 0});
}

torch::ScalarType PriorTrainConfig::checkpointed_inputs_type(const std::string& who) const {
  if (checkpointed_inputs != "float32" && precision.precision() == Precision::fp32) {
    throw Error(who + ": checkpointed_inputs " + checkpointed_inputs +
                " needs precision.mode bfloat16 or float16 (a float32 run keeps float32 activations)");
  }
  return float_type_named(checkpointed_inputs);
}

double PriorLearningRate::at(int64_t step, int64_t total_steps, int64_t reductions) const {
  if (step < warmup_steps) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (decay == "plateau") return peak * std::pow(plateau_factor, static_cast<double>(reductions));
  const double span = static_cast<double>(std::max<int64_t>(total_steps - warmup_steps, 1));
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  return end + 0.5 * (peak - end) * (1.0 + std::cos(M_PI * progress));
}

void PriorTrainConfig::visit(ConfigVisitor& v) {
  v.section("model", "transformer sizes and options", model);
  v.field("init_from", init_from,
          "prior run or checkpoint whose weights (its moving average) the run starts from, with a fresh optimizer "
          "and this schedule, instead of a random initialisation; its model section must be this one (empty: random)");
  v.section("data", "token datasets and batching", data);
  v.section("learning_rate", "warmup, then cosine or plateau decay", learning_rate);
  visit_shared_sections(v, {optimizer, run, precision, distributed});
  v.section("adapter", "low-rank adapters (LoRA) trained with the rest of the model frozen (docs/fine-tuning.md)",
            adapter);
  v.field("checkpoint_activations_every", checkpoint_activations_every,
          "recompute the activations of resblocks 0, k, 2k, ... in backward instead of keeping them "
          "(1: every resblock; 0: none)",
          {.min = 0});
  v.field("checkpointed_inputs", checkpointed_inputs,
          "storage of the input each checkpointed resblock keeps for its backward (every resblock's when sharded, "
          "else checkpoint_activations_every's): bfloat16 or float16 halve what checkpointing holds, as DALL-E's "
          "16-bit activations did (the recomputation starts from the rounded input; needs precision.mode bfloat16 "
          "or float16; bfloat16 has float32's range); float32 keeps them exact",
          dtype_choices({"float32", "bfloat16", "float16"}));
  v.field("frozen_weights", frozen_weights,
          "storage of the resblocks' frozen weight matrices (optimizer.trainable, adapters) in bfloat16 and float16 "
          "runs, which autocast casts anyway: float16 or bfloat16 halves the frozen base (float16 keeps ruDALL-E's "
          "released weights exactly); float32 (the default) keeps them as loaded",
          dtype_choices({"float32", "bfloat16", "float16"}));
  v.field("tokenizer", tokenizer, "caption tokenizer model that made the dataset's text tokens (for sample grids)");
  v.field("image_tokenizer", image_tokenizer, "dVAE or VQGAN run that made the image tokens (for sample grids)");
  v.field("sample_captions", sample_captions, "captions drawn at each validation (needs tokenizer and image_tokenizer)");
  v.field("samples_per_caption", samples_per_caption, "images per sample caption", {.min = 1, .max = 64});
  v.section("sampling", "sampling settings of the grids", sampling);
}

struct PriorTrainer::State : detail::TrainerState<PriorTrainConfig, models::Prior> {
  std::shared_ptr<data::TokenDataset> train_set, validation_set;
  std::unique_ptr<data::DataLoader<data::TokenDataset>> loader;
  at::Generator caption_dropout;
  // Plateau decay: the best validation loss, validations since it, reductions made.
  double best_validation = std::numeric_limits<double>::infinity();
  int64_t validations_since_best = 0, reductions = 0;
  PriorStepMetrics last;

  State(PriorTrainConfig c, fs::path r)
      : TrainerState("prior", std::move(c), std::move(r), /*can_shard=*/true),
        caption_dropout(at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config.run.seed) + 1)) {}

  torch::Tensor batch_tokens(const std::vector<data::TokenExample>& examples, bool drop_captions);
  PriorStepMetrics train_step(const torch::Tensor& tokens);
  bool shards_resblocks() const;
  void install_resblock_runner();
  models::ResblockRunner validation_inner_runner() const;
  void store_frozen_blocks();
  void log_step() const;
  void update_plateau(double validation_loss);

  data::LoaderPosition loader_position() const override { return loader->position(); }
  void seek_loader(const data::LoaderPosition& position) override { loader->seek(position); }
  bool may_change_on_resume(const std::string& key) const override {
    return is_run_control_key(key) || key == "sample_captions" || key == "samples_per_caption" ||
           key.starts_with("sampling.") || key == "tokenizer" || key == "image_tokenizer" ||
           key == "checkpoint_activations_every" || key == "checkpointed_inputs";
  }
  void save_extra(io::Checkpoint& checkpoint) const override;
  void restore_extra(const io::Checkpoint& checkpoint, const std::string& directory) override;

  // distributed.sharding within_node: the resblocks' shards and their moving averages
  // (float32; in host memory for 16-bit shards), and the runners that gather the blocks for
  // training and for validation on the average.
  std::unique_ptr<ShardedResblocks> shards;
  std::vector<torch::Tensor> shard_averages;
  std::shared_ptr<distributed::ShardedReducer> sharded_reducer;
  models::ResblockRunner training_runner, validation_runner;
  // The model validation and sample grids run: the validation copy with the average copied
  // in, or the sharded model itself with the average swapped in (AverageSwappedIn).
  models::Prior& validation_model();
  // While alive, a sharded model computes with its moving average: the replicated parameters'
  // values exchanged with the average's, the blocks gathered from the averaged shards and run
  // as validation runs them (float32, or autocast where blocks hold 16-bit weights).
  class AverageSwappedIn {
   public:
    explicit AverageSwappedIn(State& state);
    ~AverageSwappedIn();
    AverageSwappedIn(const AverageSwappedIn&) = delete;
    AverageSwappedIn& operator=(const AverageSwappedIn&) = delete;

   private:
    State& state_;
  };

  // Sharded, a rank reads of a checkpoint only the replicated part and its own slices.
  void resume(const std::string& directory) override;
  void restore_group(size_t g, io::TensorMap& slices, const io::TensorMap& state);
  void restore_frozen_blocks(io::TensorMap& weights);
  void log_shard_reads(const std::map<int64_t, int64_t>& bytes_by_writer) const;
  void restore_warm_q(const io::TensorMap& own);
  io::ShardLayout shard_layout(bool moments, bool errors) const;
  std::unordered_set<std::string> block_names() const;
  void build_model(bool starts_from_init);
  void cut_resblocks();
  void shard_resblocks();
  void shard_update(const io::TensorMap& scales);
  void average_shards();
  torch::Tensor average_of(const torch::Tensor& shard) const;
  void save_checkpoint() override;
  void write_own_shards(const std::string& staging, bool moments, const std::vector<torch::Tensor>& errors) const;
  void write_checkpoint_files(const std::string& staging, bool moments, bool errors, io::TensorMap frozen);
};

namespace {

// Where a sharded checkpoint keeps PowerSGD's error feedback, by parameter name, and, in each
// rank's shard file, the warm Q of its blocks of rows ("powersgd_q.<group>.<block>").
constexpr const char* kReducerErrors = "reducer.error.";
constexpr const char* kShardQ = "powersgd_q.";

void check_dataset(const data::TokenDatasetInfo& info, const models::PriorConfig& model, const std::string& where) {
  std::string problems;
  if (info.text_length != model.text_length) {
    problems += " text_length " + std::to_string(info.text_length) + " (model " + std::to_string(model.text_length) + ")";
  }
  if (info.grid_height != model.grid_size || info.grid_width != model.grid_size) {
    problems += " grid " + std::to_string(info.grid_height) + "x" + std::to_string(info.grid_width) + " (model " +
                std::to_string(model.grid_size) + ")";
  }
  if (info.text_vocab_size > model.text_vocab_size) {
    problems += " text vocabulary " + std::to_string(info.text_vocab_size) + " (model " +
                std::to_string(model.text_vocab_size) + ")";
  }
  if (info.image_vocab_size > model.image_vocab_size) {
    problems += " image vocabulary " + std::to_string(info.image_vocab_size) + " (model " +
                std::to_string(model.image_vocab_size) + ")";
  }
  if (!problems.empty()) throw Error(where + ": the token dataset does not fit the model:" + problems);
}

// Weight decay for the matrices only: DALL-E keeps gains, biases and embeddings undecayed.
bool decayed_by_adamw(const std::string& name, const torch::Tensor& parameter) {
  return parameter.dim() == 2 && name.find("embedding") == std::string::npos;
}

std::vector<torch::optim::OptimizerParamGroup> decay_groups(std::vector<torch::Tensor> decayed,
                                                            std::vector<torch::Tensor> undecayed,
                                                            double weight_decay) {
  auto decay_options = std::make_unique<torch::optim::AdamWOptions>();
  decay_options->weight_decay(weight_decay);
  auto plain_options = std::make_unique<torch::optim::AdamWOptions>();
  plain_options->weight_decay(0.0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::move(decayed), std::move(decay_options));
  groups.emplace_back(std::move(undecayed), std::move(plain_options));
  return groups;
}

// The parameters for which `keep` is true, in AdamW's two groups.
std::vector<torch::optim::OptimizerParamGroup> parameter_groups(
    models::PriorImpl& model, double weight_decay,
    const std::function<bool(const torch::Tensor&)>& keep = [](const torch::Tensor&) { return true; }) {
  std::vector<torch::Tensor> decayed, undecayed;
  for (const auto& item : model.named_parameters()) {
    if (keep(item.value())) (decayed_by_adamw(item.key(), item.value()) ? decayed : undecayed).push_back(item.value());
  }
  return decay_groups(std::move(decayed), std::move(undecayed), weight_decay);
}

// The moving average of a trained prior of the same sizes and options, into `model`.
void initialise_from(models::PriorImpl& model, const PriorTrainConfig& config) {
  auto trained = models::load_trained_prior(config.init_from);
  auto wanted = config.model;
  const auto ours = flatten_config(visit_of(wanted)), theirs = flatten_config(visit_of(trained.config));
  std::string differences;
  for (size_t i = 0; i < ours.size() && i < theirs.size(); ++i) {
    if (ours[i] == theirs[i]) continue;
    differences += " model." + ours[i].first + " " + theirs[i].second + " (run " + ours[i].second + ")";
  }
  if (!differences.empty()) {
    throw Error("prior training: init_from " + config.init_from + " is another model:" + differences +
                "; copy its model section into the config");
  }
  io::load_state_dict(model, io::state_dict(*trained.model), config.init_from + " (init_from)");
}

}  // namespace

PriorTrainer::PriorTrainer(PriorTrainConfig config, std::string run_directory) {
  if (config.data.train.empty()) throw Error("prior training: data.train must name a token dataset folder");
  config.model.validate();
  state_ = detail::start_trainer<State>(std::move(config), run_directory, "prior");
  auto& s = *state_;
  s.train_set = data::TokenDataset::open(s.config.data.train);
  check_dataset(s.train_set->info(), s.config.model, s.config.data.train);
  if (!s.config.data.validation.empty()) {
    s.validation_set = data::TokenDataset::open(s.config.data.validation);
    check_dataset(s.validation_set->info(), s.config.model, s.config.data.validation);
  }
  check_weights_storage(s.config.precision, s.shards_resblocks(), "prior training");
  s.config.checkpointed_inputs_type("prior training");
  if (s.config.checkpointed_inputs != "float32" && !s.shards_resblocks() && s.config.checkpoint_activations_every == 0) {
    log::warn("prior training: checkpointed_inputs ", s.config.checkpointed_inputs,
              " changes nothing: no resblock is checkpointed (checkpoint_activations_every 0, not sharded)");
  }
  // A resumed run has its own weights; init_from is read only to start one.
  const bool starts_from_init = !s.config.init_from.empty() && !s.checkpoints.latest();
  s.build_model(starts_from_init);
  if (starts_from_init) initialise_from(*s.model, s.config);
  const bool sharded = s.shards_resblocks();
  s.place_model(sharded);
  s.store_frozen_blocks();
  if (starts_from_init) s.refer_to_base(s.config.init_from);
  // Sharded, the blocks are cut before the average and the update state are made, so that no
  // rank ever holds a whole average of them (nor a validation copy).
  s.cut_resblocks();
  if (sharded) s.start_average();
  s.build_update(parameter_groups(*s.model, s.config.optimizer.weight_decay), s.config.learning_rate.peak,
                 std::make_unique<ModelPrecision>(s.config.precision, s.model->parameters(),
                                                  resblock_parameter_groups(s.model->resblocks()), s.replicas()),
                 {.measure_norm = true});
  s.loader = std::make_unique<data::DataLoader<data::TokenDataset>>(
      s.train_set, data::LoaderOptions{.batch_size = s.rank_batch(s.config.data.batch_size),
                                       .workers = s.config.data.workers,
                                       .sampler = s.shard()});
  // Sharded before the resume, which then reads only this rank's part of the checkpoint.
  s.shard_resblocks();
  s.open_run(/*samples=*/true);
  s.install_resblock_runner();
}

PriorTrainer::~PriorTrainer() = default;
int64_t PriorTrainer::step() const { return state_->step; }
PriorStepMetrics PriorTrainer::last_metrics() const { return state_->last; }
models::Prior& PriorTrainer::model() { return state_->model; }
const GradientScaler* PriorTrainer::gradient_scaler() const { return state_->precision->scaler(); }

bool PriorTrainer::State::shards_resblocks() const {
  return config.distributed.sharding == "within_node" && job->place().local_world_size > 1;
}

void PriorTrainer::State::install_resblock_runner() {
  const auto mode = config.precision.precision();
  // Sharded blocks recompute their forward in backward anyway.
  const int64_t checkpoint_every = shards ? 0 : config.checkpoint_activations_every;
  const auto kept_as = config.checkpointed_inputs_type("prior training");
  models::ResblockRunner runner;
  if (mode != Precision::fp32 || checkpoint_every > 0) {
    runner = make_training_runner(model->resblocks(), {.precision = mode,
                                                       .scaler = precision->scaler(),
                                                       .checkpoint_every = checkpoint_every,
                                                       .checkpointed_inputs = kept_as});
  }
  if (shards) {
    if (!runner) {
      runner = [](models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
        return x + block.branch(x, context);
      };
    }
    runner = shards->runner(std::move(runner), kept_as);
    training_runner = runner;
    validation_runner = shards->runner(validation_inner_runner());
  }
  if (runner) model->set_resblock_runner(std::move(runner));
}

// The blocks as a validation copy runs them: in float32, or under autocast where they hold
// 16-bit weights (frozen_weights, precision.weights).
models::ResblockRunner PriorTrainer::State::validation_inner_runner() const {
  const bool sixteen_bit = config.frozen_weights != "float32" || config.precision.weights != "float32";
  const auto autocast = sixteen_bit ? config.precision.autocast_dtype() : std::nullopt;
  return [autocast](models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
    AutocastGuard guard(x.device().type(), autocast);
    return x + block.branch(x, context).to(x.scalar_type());
  };
}

// frozen_weights: the resblocks' frozen matrices in 16 bits, shared with the validation model,
// whose blocks then run under autocast as the training runner's do.
void PriorTrainer::State::store_frozen_blocks() {
  if (config.frozen_weights == "float32") return;
  const auto autocast = config.precision.autocast_dtype();
  if (!autocast) {
    throw Error("prior training: frozen_weights " + config.frozen_weights +
                " needs precision.mode bfloat16 or float16 (a float32 run computes without autocast)");
  }
  const auto stored = store_frozen_matrices(*model, "resblocks.", float_type_named(config.frozen_weights));
  if (stored.empty()) {
    log::warn(what, ": frozen_weights ", config.frozen_weights, " changes nothing: no resblock matrix is frozen");
    return;
  }
  auto parameters = model->named_parameters();
  int64_t values = 0;
  for (const auto& name : stored) values += parameters[name].numel();
  if (ema_model) {
    auto validation = ema_model->named_parameters();
    for (const auto& name : stored) validation[name].set_data(parameters[name]);
    ema_model->set_resblock_runner(validation_inner_runner());
  }
  log::info(what, ": the resblocks' ", values, " frozen matrix values are kept in ", config.frozen_weights,
            "; validation runs their blocks in ", config.precision.mode);
}

// A sharded run that trains every parameter of a random start (no init_from, adapters or
// optimizer.trainable) builds the prior one block at a time, each cut into its shards on the
// run's device before the next exists: no rank ever holds the whole prior, and the weights are
// those of a whole build, bit for bit. Otherwise the prior is built whole, then loaded, frozen
// and cut (cut_resblocks).
void PriorTrainer::State::build_model(bool starts_from_init) {
  const bool trains_everything = !config.adapter.enabled() && config.optimizer.trainable.empty();
  if (!shards_resblocks() || starts_from_init || !trains_everything) {
    model = models::Prior(config.model);
    return;
  }
  shards = std::make_unique<ShardedResblocks>(2 * static_cast<size_t>(config.model.layers), decayed_by_adamw,
                                              job->within_node(), config.distributed.overlap,
                                              models::is_adapter_tensor, config.precision.weights_dtype());
  model = models::Prior(config.model, [this](size_t b, models::ResblockImpl& block) {
    block.to(device);
    shards->add_block(b, block);
  });
#if defined(__GLIBC__)
  // Each block drawn whole and freed leaves holes in the C heap between the shards kept there
  // (glibc's dynamic mmap threshold puts them on the heap once large blocks have been freed):
  // about 200 MiB per rank resident at 8 layers of width 2048 that nothing holds. Returned.
  malloc_trim(0);
#endif
  log::info(what, ": the prior was built one resblock at a time, each cut into ", job->within_node()->size(),
            " shards as it was drawn");
}

// Each rank of a machine keeps 1/N of every resblock (distributed.sharding within_node), of
// its frozen base too; the blocks' own tensors are emptied. Adapters, small, stay whole.
void PriorTrainer::State::cut_resblocks() {
  if (shards || config.distributed.sharding != "within_node" || job->place().local_world_size == 1) return;
  shards = std::make_unique<ShardedResblocks>(*model, decayed_by_adamw, job->within_node(),
                                              config.distributed.overlap, models::is_adapter_tensor,
                                              config.precision.weights_dtype());
}

// The update state moved to the shards, before any resume, on a fresh update: no moments
// yet, an average equal to the weights (each shard's starts as the shard), the first scales.
void PriorTrainer::State::shard_resblocks() {
  if (!shards) return;
  io::TensorMap scales;
  precision->save_state(scales, "");
  const auto& sharded = *shards->parameters();
  // AdamW steps the shards and what trains whole (outside the blocks, and the adapters).
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
  shard_update(scales);
  const int64_t ranks = job->place().local_world_size;
  log::info("prior: the ", model->resblocks().size(), " resblocks are sharded between the ", ranks,
            " ranks of each machine; each holds 1/", ranks, " of their weights, gradients and moments",
            frozen_names().empty() ? "" : " (of their frozen weights too; adapters stay whole)",
            job->place().nodes > 1 ? ", replicated on the " + std::to_string(job->place().nodes) + " machines" : "");
}

// The precision (per-resblock fp16 scales over each block's shards, as `scales` left them)
// and the update step of the shards.
void PriorTrainer::State::shard_update(const io::TensorMap& scales) {
  std::vector<torch::Tensor> learned;
  for (const auto& group : optimizer->param_groups()) {
    learned.insert(learned.end(), group.params().begin(), group.params().end());
  }
  precision = std::make_unique<ModelPrecision>(config.precision, learned, shards->scale_groups(), replicas());
  precision->load_state(scales, "");
  update = std::make_unique<UpdateStep>(*optimizer, *precision,
                                        UpdateOptions{.what = what,
                                                      .grad_clip = config.optimizer.grad_clip,
                                                      .measure_norm = true,
                                                      .after_step = [this] { average_shards(); }},
                                        ema.get(), model.get());
  sharded_reducer = std::make_shared<distributed::ShardedReducer>(
      shards->parameters(), job->group(), job->within_node(), job->across_nodes(), bucket_bytes(config.distributed),
      powersgd_options(config.distributed, config.run), config.distributed.overlap);
  update->set_reducer(sharded_reducer);
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
  restore_frozen_blocks(checkpoint.weights);
  io::load_state_dict(*model, checkpoint.weights, directory + "/" + io::kWeightsFile, block_names());
  checkpoint.weights.clear();
  ema->load(io::with_prefix_removed(checkpoint.state, "ema."));
  const auto moments = io::with_prefix_removed(checkpoint.state, "adamw.");
  load_adamw_state(*optimizer, *model, moments);
  restore_warm_q(read.own);
  const auto progress = restore_progress(checkpoint);
  keep_threads_of(checkpoint);
  precision->load_state(checkpoint.state, "gradient_scaler.");
  sharded_reducer->load_state(checkpoint.state, "reducer.");
  restore_extra(checkpoint, directory);
  seek_loader(progress.position);
  resumed(directory, progress.step);
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

// The frozen blocks' shards from the checkpoint's weights (its base's, filled in).
void PriorTrainer::State::restore_frozen_blocks(io::TensorMap& weights) { shards->restore_frozen(weights); }

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
  // Frozen blocks' weights are gathered (by every rank) only where no base holds them, or to
  // write the base's copy.
  io::TensorMap frozen;
  if (base_checkpoint.empty() || write_base_copy_) frozen = shards->frozen_weights();
  if (write_base_copy_) write_base_copy(frozen);
  if (writes_files) checkpoints.stage(step);
  job->barrier();
  const auto staging = checkpoints.staging_for(step);
  const bool moments = optimizer->state().count(shards->parameters()->shard(0).unsafeGetTensorImpl()) > 0;
  // PowerSGD's error feedback, as its mean over the machines: every rank takes part.
  std::vector<torch::Tensor> errors;
  for (size_t g = 0; g < shards->trained_groups(); ++g) errors.push_back(sharded_reducer->shard_error(g));
  const bool has_errors = !errors.empty() && errors.front().defined();
  if (job->place().node_rank == 0) write_own_shards(staging, moments, errors);
  if (writes_files) write_checkpoint_files(staging, moments, has_errors, std::move(frozen));
  job->barrier();
  if (writes_files) log::info(what, ": checkpoint ", checkpoints.publish(step));
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
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(
        *optimizer->state().at(sharded.shard(g).unsafeGetTensorImpl()));
    mine.emplace("exp_avg" + index, adam.exp_avg().cpu());
    mine.emplace("exp_avg_sq" + index, adam.exp_avg_sq().cpu());
  }
  io::write_checkpoint_shard(staging, job->place().local_rank, job->place().local_world_size, mine);
}

// `frozen`: the frozen blocks' weights, written whole where the run has no base.
void PriorTrainer::State::write_checkpoint_files(const std::string& staging, bool moments, bool errors,
                                                 io::TensorMap frozen) {
  const auto& sharded = *shards->parameters();
  const auto layout = shard_layout(moments, errors);
  auto weights = io::state_dict(*model);
  for (const auto& name : block_names()) weights.erase(name);
  if (base_checkpoint.empty()) {
    weights.merge(frozen);
  } else {
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
  precision->save_state(checkpoint.state, "gradient_scaler.");
  sharded_reducer->save_state(checkpoint.state, "reducer.");
  if (!base_checkpoint.empty()) io::refer_to_base(checkpoint, base_checkpoint);
  save_extra(checkpoint);
  io::write_checkpoint_files(staging, std::move(checkpoint), layout);
}

torch::Tensor PriorTrainer::State::batch_tokens(const std::vector<data::TokenExample>& examples,
                                                bool drop_captions) {
  // One draw per example of the global batch, of which this rank's examples take theirs (the
  // sampler deals the batch's positions out in turn): any number of ranks drops the captions
  // one process would.
  const auto draws = drop_captions ? torch::rand({config.data.batch_size}, caption_dropout) : torch::Tensor();
  std::vector<torch::Tensor> rows;
  for (size_t i = 0; i < examples.size(); ++i) {
    auto text = examples[i].text_tokens;
    const int64_t position = static_cast<int64_t>(i) * job->size() + job->rank();
    if (drop_captions && position < draws.size(0) && draws[position].item<double>() < config.data.caption_dropout) {
      text = models::empty_caption(config.model.text_length)[0];
    }
    rows.push_back(torch::cat({text, examples[i].image_tokens.flatten()}));
  }
  return torch::stack(rows).to(device);
}

PriorStepMetrics PriorTrainer::State::train_step(const torch::Tensor& tokens) {
  PriorStepMetrics metrics;
  metrics.learning_rate = config.learning_rate.at(step, config.run.steps, reductions);
  set_learning_rate(metrics.learning_rate);
  model->train();
  const auto loss = models::prior_loss(model->forward(tokens), tokens, config.model);
  const auto update_result = apply_update(loss.total);
  metrics.skipped = update_result.skipped;
  metrics.grad_norm = update_result.grad_norm;
  ++step;
  metrics.step = step;
  metrics.loss = loss.total.item<double>();
  metrics.text_loss = loss.text.item<double>();
  metrics.image_loss = loss.image.item<double>();
  return metrics;
}

void PriorTrainer::State::log_step() const {
  append_metrics({{"step", last.step},
                  {"loss", last.loss},
                  {"text_loss", last.text_loss},
                  {"image_loss", last.image_loss},
                  {"grad_norm", last.grad_norm},
                  {"learning_rate", last.learning_rate}});
}

void PriorTrainer::run() {
  auto& s = *state_;
  detail::run_training_loop(
      s, detail::intervals_of(s.config.run),
      {.update =
           [&] {
             const auto batch = s.loader->next();
             s.last = s.train_step(s.batch_tokens(batch.examples, /*drop_captions=*/true));
             return s.last.loss;
           },
       .log = [&] { s.log_step(); },
       .validate =
           [&] {
             const auto validation = validate();
             if (std::isnan(validation.loss)) return;  // no data.validation: nothing to report
             log::info("prior: update ", s.step, " loss ", s.last.loss, " validation loss ", validation.loss,
                       " (text ", validation.text_loss, ", image ", validation.image_loss, ")");
           },
       .checkpoint = [&] { s.save_checkpoint(); }});
}

void PriorTrainer::State::update_plateau(double validation_loss) {
  if (validation_loss < best_validation * (1.0 - 1e-4)) {
    best_validation = validation_loss;
    validations_since_best = 0;
    return;
  }
  if (++validations_since_best >= config.learning_rate.plateau_patience &&
      reductions < config.learning_rate.plateau_reductions && step >= config.learning_rate.warmup_steps) {
    ++reductions;
    validations_since_best = 0;
    log::info("prior: validation loss on a plateau; learning rate x", config.learning_rate.plateau_factor);
  }
}

namespace {

// Every rank that holds a part of a sharded model draws (their gathers go together); the
// one that `writes` writes the grid to `path`.
void write_sample_grid(models::Prior& model, const PriorTrainConfig& config, const fs::path& path, bool writes) {
  const auto tokenizer = text::Tokenizer::load(config.tokenizer);
  auto decoder = models::load_image_tokenizer(config.image_tokenizer);
  std::vector<torch::Tensor> captions, tiles;
  std::vector<std::string> labels;
  for (const auto& caption : config.sample_captions) {
    const auto ids = torch::tensor(tokenizer.encode(caption).ids, torch::kInt64);
    for (int64_t i = 0; i < config.samples_per_caption; ++i) {
      captions.push_back(ids);
      labels.push_back(caption);
    }
  }
  const auto tokens = models::sample_image_tokens(model, torch::stack(captions), config.sampling);
  if (!writes) return;
  torch::NoGradGuard no_grad;
  const auto images = decoder.model->decode_tokens(tokens.cpu());
  for (int64_t i = 0; i < images.size(0); ++i) tiles.push_back(images[i]);
  data::write_png(path.string(), data::make_grid(tiles, labels, {.columns = config.samples_per_caption * 2,
                                                                 .tile_size = 128}));
}

}  // namespace

PriorValidation PriorTrainer::validate() {
  auto& s = *state_;
  torch::NoGradGuard no_grad;
  const State::AverageSwappedIn swapped(s);
  auto& average = s.validation_model();
  average->eval();
  PriorValidation result{std::nan(""), std::nan(""), std::nan("")};
  if (s.validation_set) {
    const int64_t count = std::min<int64_t>(static_cast<int64_t>(s.validation_set->size()), 256);
    double total = 0, text = 0, image = 0;
    int64_t batches = 0;
    for (int64_t begin = 0; begin < count; begin += s.config.data.batch_size) {
      std::vector<data::TokenExample> examples;
      for (int64_t i = begin; i < std::min(count, begin + s.config.data.batch_size); ++i) {
        std::mt19937_64 rng(static_cast<uint64_t>(i));
        if (auto example = s.validation_set->get(static_cast<size_t>(i), rng)) examples.push_back(std::move(*example));
      }
      const auto tokens = s.batch_tokens(examples, /*drop_captions=*/false);
      const auto loss = models::prior_loss(average->forward(tokens), tokens, s.config.model);
      total += loss.total.item<double>();
      text += loss.text.item<double>();
      image += loss.image.item<double>();
      ++batches;
    }
    result = {total / batches, text / batches, image / batches};
    s.metrics_log.append({{"step", s.step}, {"validation_loss", result.loss}, {"validation_text_loss", result.text_loss},
                      {"validation_image_loss", result.image_loss}});
    if (s.config.learning_rate.decay == "plateau") s.update_plateau(result.loss);
  }
  // Sharded, the first machine's ranks draw together.
  const bool draws = s.shards ? s.job->place().node_rank == 0 : s.writes_files;
  if (draws && !s.config.sample_captions.empty() && !s.config.tokenizer.empty() && !s.config.image_tokenizer.empty()) {
    char name[48];
    std::snprintf(name, sizeof name, "samples/step-%09lld.png", static_cast<long long>(s.step));
    write_sample_grid(average, s.config, s.run / name, s.writes_files);
  }
  return result;
}

void PriorTrainer::State::save_extra(io::Checkpoint& checkpoint) const {
  checkpoint.state.emplace("rng.caption_dropout", caption_dropout.get_state());
  checkpoint.state_metadata.insert({{"best_validation", std::to_string(best_validation)},
                                    {"validations_since_best", std::to_string(validations_since_best)},
                                    {"reductions", std::to_string(reductions)}});
}

void PriorTrainer::State::restore_extra(const io::Checkpoint& checkpoint, const std::string&) {
  caption_dropout.set_state(checkpoint.state.at("rng.caption_dropout"));
  const auto& meta = checkpoint.state_metadata;
  best_validation = std::stod(meta.at("best_validation"));
  validations_since_best = std::stoll(meta.at("validations_since_best"));
  reductions = std::stoll(meta.at("reductions"));
}

}  // namespace dalle::train
