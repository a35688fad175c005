#include "dalle/train/precision.h"

#include <ATen/autocast_mode.h>

#include "dalle/device.h"
#include "dalle/error.h"

namespace dalle::train {

void GradientScalingConfig::visit(ConfigVisitor& v) {
  v.field("initial_log2", initial_log2, "fp16: log2 of every scale at the start, before x replicas (DALL-E: 13)",
          {.min = -64.0, .max = 120.0});
  v.field("min_log2", min_log2, "fp16: log2 of the smallest scale, before x replicas (DALL-E: 7)",
          {.min = -64.0, .max = 120.0});
  v.field("max_log2", max_log2, "fp16: log2 of the largest scale, before x replicas (DALL-E: 24)",
          {.min = -64.0, .max = 120.0});
  v.field("growth_log2", growth_log2,
          "fp16: log2 of the factor applied to a scale after an update with finite gradients (DALL-E: 1/1000)",
          {.min = 0.0, .max = 8.0});
  v.field("backoff_log2", backoff_log2,
          "fp16: log2 of the divisor of a scale whose gradients were not finite; the update is skipped "
          "(DALL-E: 0.5, a division by sqrt 2)",
          {.min = 0.0, .max = 8.0});
  v.field("backoff_interval", backoff_interval, "fp16: updates between two divisions of one scale (DALL-E: 125)",
          {.min = 0});
}

void GradientScalingConfig::validate() const {
  if (!(min_log2 <= initial_log2 && initial_log2 <= max_log2)) {
    throw ConfigError("precision.gradient_scaling: need min_log2 <= initial_log2 <= max_log2");
  }
}

void PrecisionConfig::visit(ConfigVisitor& v) {
  v.field("mode", mode,
          "float32: everything in float32 (the reference); bfloat16: autocast to bfloat16; float16: autocast to "
          "float16 with dynamic gradient scales (one per resblock in the prior)",
          dtype_choices({"float32", "bfloat16", "float16"}));
  v.field("adam_moments", adam_moments, "storage of Adam's moments (bfloat16 halves the optimizer's memory)",
          dtype_choices({"float32", "bfloat16"}));
  v.field("weights", weights,
          "storage of the trained resblock matrices and their gradients in a prior sharded within the machine "
          "(distributed.sharding within_node; needs precision.mode bfloat16 or float16): bfloat16 or float16 halve "
          "them; each update is computed in float32 and rounded stochastically, and their moving average is kept "
          "in float32 in host memory (docs/distributed.md); float32 keeps them as they are",
          dtype_choices({"float32", "bfloat16", "float16"}));
  v.section("gradient_scaling", "fp16 only: the dynamic gradient scales", gradient_scaling);
}

Precision PrecisionConfig::precision() const {
  if (mode == "bfloat16") return Precision::bf16;
  if (mode == "float16") return Precision::fp16;
  return Precision::fp32;
}

std::optional<torch::ScalarType> autocast_dtype(Precision precision) {
  switch (precision) {
    case Precision::bf16: return torch::kBFloat16;
    case Precision::fp16: return torch::kFloat16;
    case Precision::fp32: break;
  }
  return std::nullopt;
}

std::optional<torch::ScalarType> PrecisionConfig::autocast_dtype() const { return train::autocast_dtype(precision()); }

torch::ScalarType PrecisionConfig::weights_dtype() const { return float_type_named(weights); }

torch::ScalarType PrecisionConfig::moments_dtype() const {
  return float_type_named(adam_moments);
}

void check_weights_storage(const PrecisionConfig& precision, bool sharded, const std::string& who) {
  if (precision.weights == "float32") return;
  const std::string key = who + ": precision.weights " + precision.weights;
  if (!precision.autocast_dtype()) {
    throw Error(key + " needs precision.mode bfloat16 or float16 (the blocks compute with their 16-bit weights)");
  }
  if (!sharded) {
    throw Error(key + " stores the shards of the resblocks: it needs distributed.sharding within_node (on one "
                      "rank too)");
  }
}

AutocastGuard::AutocastGuard(torch::DeviceType device, std::optional<torch::ScalarType> dtype) : device_(device) {
  if (!dtype) return;
  active_ = true;
  was_enabled_ = at::autocast::is_autocast_enabled(device_);
  previous_dtype_ = at::autocast::get_autocast_dtype(device_);
  at::autocast::set_autocast_enabled(device_, true);
  at::autocast::set_autocast_dtype(device_, *dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  // The cast weights are cached while autocast is on; the outermost scope frees them.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, was_enabled_);
  at::autocast::set_autocast_dtype(device_, previous_dtype_);
}

}  // namespace dalle::train
