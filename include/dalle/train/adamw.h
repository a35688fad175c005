#pragma once
// AdamW whose two moments are stored in a chosen type: fp32 is torch's AdamW unchanged;
// bf16 halves the optimizer's memory (DALL-E kept its moments in 16 bits), while every
// update is still computed in fp32.
#include <torch/optim/adamw.h>

#include <vector>

namespace dalle::train {

class AdamW : public torch::optim::AdamW {
 public:
  AdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults,
        torch::ScalarType moments = torch::kFloat32);

  torch::Tensor step(LossClosure closure = nullptr) override;
  torch::ScalarType moments() const { return moments_; }

 private:
  torch::ScalarType moments_;
};

}  // namespace dalle::train
