#pragma once
// The numeric precision of training, one `precision` config section for every trainer:
// fp32 (the reference), bf16 autocast, or fp16 autocast with dynamic gradient scales
// (per resblock for the prior, as in DALL-E's appendix D). The fp16 constants are DALL-E's.
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "dalle/config.h"

namespace dalle::train {

enum class Precision { fp32, bf16, fp16 };

// The autocast type of fp16/bf16 (none for fp32).
std::optional<torch::ScalarType> autocast_dtype(Precision precision);

// Scales are powers of two, times the number of data-parallel replicas: start at 2^13,
// grow by 2^(1/1000) per update with finite gradients, back off by sqrt(2) on non-finite
// ones (at most once per `backoff_interval` updates), stay within [2^7, 2^24].
struct GradientScalingConfig {
  double initial_log2 = 13;
  double min_log2 = 7;
  double max_log2 = 24;
  double growth_log2 = 1e-3;
  double backoff_log2 = 0.5;
  int64_t backoff_interval = 125;

  void visit(ConfigVisitor& v);
  void validate() const;
};

struct PrecisionConfig {
  std::string mode = "float32";
  std::string adam_moments = "float32";
  std::string weights = "float32";
  GradientScalingConfig gradient_scaling;

  void visit(ConfigVisitor& v);
  Precision precision() const;
  // The storage of the sharded resblocks' trained matrices (float32 unless `weights` says).
  torch::ScalarType weights_dtype() const;
  // autocast_dtype(precision()).
  std::optional<torch::ScalarType> autocast_dtype() const;
  torch::ScalarType moments_dtype() const;
};

// precision.weights' conditions, for the trainer and the planner alike: 16-bit weights are
// the shards of the resblocks (`sharded`: sharding within_node on several ranks per machine),
// computed under autocast. Throws Error naming the keys, prefixed by `who`.
void check_weights_storage(const PrecisionConfig& precision, bool sharded, const std::string& who);

// Runs the ops of its scope in `dtype` on `device` by autocast (nothing when dtype is empty),
// restoring the previous autocast state on exit.
class AutocastGuard {
 public:
  AutocastGuard(torch::DeviceType device, std::optional<torch::ScalarType> dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  torch::DeviceType device_;
  bool active_ = false, was_enabled_ = false;
  torch::ScalarType previous_dtype_ = torch::kFloat32;
};

}  // namespace dalle::train
