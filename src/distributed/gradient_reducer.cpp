#include "dalle/distributed/gradient_reducer.h"

#include <torch/torch.h>

namespace dalle::distributed {

double GradientReducer::gradient_norm(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> norms;
  for (const auto& parameter : parameters) {
    if (parameter.grad().defined()) norms.push_back(torch::linalg_vector_norm(parameter.grad(), 2));
  }
  if (norms.empty()) return 0.0;
  return torch::linalg_vector_norm(torch::stack(norms), 2).item<double>();
}

}  // namespace dalle::distributed
