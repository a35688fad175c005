#include "dalle/models/prior_flops.h"

#include "dalle/models/linear.h"

namespace dalle::models {

int64_t matrix_weights(const torch::nn::Module& module) {
  int64_t weights = 0;
  for (const auto& child : module.modules()) {
    if (const auto* linear = dynamic_cast<const LinearImpl*>(child.get())) weights += linear->weight.numel();
  }
  return weights;
}

double prior_flops_per_token(double matrix_weights, const PriorConfig& config) {
  return 6.0 * matrix_weights + 6.0 * static_cast<double>(config.layers) * static_cast<double>(config.length()) *
                                    static_cast<double>(config.width);
}

}  // namespace dalle::models
