#pragma once
// The prior trainer's state, shared by its files: prior_trainer.cpp (the config, the update,
// validation) and prior_sharding.cpp (the sharded prior: built and cut, resumed and written).
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "dalle/data/loader.h"
#include "dalle/data/token_dataset.h"
#include "dalle/distributed/sharded_reducer.h"
#include "dalle/io/sharded_checkpoint.h"
#include "dalle/models/trained.h"
#include "dalle/train/sharded_prior.h"
#include "dalle/train/trainers/prior_trainer.h"
#include "train/trainer_state.h"
#include "train/trainers/prior_weight_decay.h"

namespace dalle::train {

struct PriorTrainer::State : detail::TrainerState<PriorTrainConfig, models::Prior> {
  std::shared_ptr<data::TokenDataset> train_set, validation_set, retention_set;
  std::unique_ptr<data::DataLoader<data::TokenDataset>> loader;
  at::Generator caption_dropout;
  // Plateau decay: the best validation loss, validations since it, reductions made.
  double best_validation = std::numeric_limits<double>::infinity();
  int64_t validations_since_best = 0, reductions = 0;
  // data.retention's loss before the first update (NaN until measured, or without it).
  double retention_start = std::numeric_limits<double>::quiet_NaN();
  // keep_best: the best validation image loss of a kept checkpoint.
  double kept_best = std::numeric_limits<double>::infinity();
  PriorStepMetrics last;

  State(PriorTrainConfig c, std::filesystem::path r)
      : TrainerState("prior", std::move(c), std::move(r), /*can_shard=*/true),
        caption_dropout(at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config.run.seed) + 1)) {}

  torch::Tensor batch_tokens(const std::vector<data::TokenExample>& examples, bool drop_captions);
  PriorStepMetrics train_step(const torch::Tensor& tokens);
  bool shards_resblocks() const;
  void install_resblock_runner();
  models::ResblockRunner validation_inner_runner() const;
  void store_frozen_blocks();
  // frozen_weights' storage of the resblocks' frozen matrices (none: float32); throws unless
  // precision.mode computes under autocast.
  std::optional<torch::ScalarType> frozen_matrix_storage() const;
  void log_step() const;
  void update_plateau(double validation_loss);
  // The average's loss on (at most 256 of) `set`'s examples, the average swapped in by the caller.
  PriorValidation loss_on(data::TokenDataset& set);
  // Before the first update of a run with data.retention: its loss as the model starts.
  void measure_retention_start();
  // checkpoints/best names this step's checkpoint (written by then).
  void mark_best() const;

  data::LoaderPosition loader_position() const override { return loader->position(); }
  void seek_loader(const data::LoaderPosition& position) override { loader->seek(position); }
  bool may_change_on_resume(const std::string& key) const override {
    return is_run_control_key(key) || key == "sample_captions" || key == "samples_per_caption" ||
           key.starts_with("sampling.") || key == "tokenizer" || key == "image_tokenizer" ||
           key == "checkpoint_activations_every" || key == "checkpointed_inputs";
  }
  void save_extra(io::Checkpoint& checkpoint) const override;
  void restore_extra(const io::Checkpoint& checkpoint, const std::string& directory) override;

  // distributed.sharding within_node: the prior's shards and their moving averages
  // (float32; in host memory for 16-bit shards), and the runners that gather the blocks for
  // training and for validation on the average.
  std::unique_ptr<ShardedPrior> shards;
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
  void log_shard_reads(const std::map<int64_t, int64_t>& bytes_by_writer) const;
  void restore_warm_q(const io::TensorMap& own);
  io::ShardLayout shard_layout(bool moments, bool errors) const;
  std::unordered_set<std::string> block_names() const;
  void parallelize(std::optional<models::TrainedPriorWeights> init);
  void build_model(const models::TrainedPriorWeights* init);
  void cut_into_shards();
  void build_sharded_update();
  void average_shards();
  torch::Tensor average_of(const torch::Tensor& shard) const;
  void save_checkpoint() override;
  void write_own_shards(const std::string& staging, bool moments, const std::vector<torch::Tensor>& errors) const;
  void write_checkpoint_files(const std::string& staging, bool moments, bool errors);
  void write_sharded_base_copy();
  void write_frozen_groups(io::SafetensorsWriter* writer) const;
};

namespace prior_training {

// Where a sharded checkpoint keeps PowerSGD's error feedback, by parameter name, and, in each
// rank's shard file, the warm Q of its blocks of rows ("powersgd_q.<group>.<block>").
inline constexpr const char* kReducerErrors = "reducer.error.";
inline constexpr const char* kShardQ = "powersgd_q.";

inline std::vector<torch::optim::OptimizerParamGroup> decay_groups(std::vector<torch::Tensor> decayed,
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
inline std::vector<torch::optim::OptimizerParamGroup> parameter_groups(
    models::PriorImpl& model, double weight_decay,
    const std::function<bool(const torch::Tensor&)>& keep = [](const torch::Tensor&) { return true; }) {
  std::vector<torch::Tensor> decayed, undecayed;
  for (const auto& item : model.named_parameters()) {
    if (keep(item.value())) (decayed_by_adamw(item.key(), item.value()) ? decayed : undecayed).push_back(item.value());
  }
  return decay_groups(std::move(decayed), std::move(undecayed), weight_decay);
}

}  // namespace prior_training
}  // namespace dalle::train
