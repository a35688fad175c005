#pragma once
// One optimizer update, the same in every trainer: zero_grad, the backward pass of the
// (scaled) loss, one finite flag per scale group (agreed on by the replicas), unscaling, the
// gradient reduction across data-parallel replicas (the hook point the distributed layer
// fills; nothing happens in one process), clipping of the global gradient norm, the
// optimizer step and the moving average of the weights. A non-finite gradient skips the
// update: the weights, the moments and the average are left as they were. A gradient the
// reducer hands a parameter before backward (PowerSGD's error feedback, which backward adds
// to) is brought to backward's fp16 scales first, and one the reducer keeps compressed after
// reducing is taken as AdamW steps its parameter (distributed/gradient_reducer.h).
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dalle/distributed/gradient_reducer.h"
#include "dalle/train/ema.h"
#include "dalle/train/model_precision.h"

namespace dalle::train {

struct UpdateOptions {
  std::string what = {};   // names the trainer in the warning of a skipped update
  double grad_clip = 0;    // clip the global gradient norm to this; 0: no clipping
  bool measure_norm = false;  // measure the norm even when not clipping
  // Constraints on the weights after each step, before they are averaged (CLIP's bound
  // on its logit scale).
  std::function<void()> after_step = {};
};

struct UpdateResult {
  bool skipped = false;  // a non-finite gradient: nothing was changed
  double grad_norm = 0;  // before clipping; NaN when skipped, 0 when neither clipped nor measured
};

class UpdateStep {
 public:
  // `optimizer` steps the parameters `precision` watches; `ema`, when given, averages
  // `averaged` after each step. All must outlive the UpdateStep.
  UpdateStep(torch::optim::Optimizer& optimizer, ModelPrecision& precision, UpdateOptions options,
             Ema* ema = nullptr, const torch::nn::Module* averaged = nullptr);

  // Backpropagates `loss` and updates; `update` (1-based) names it in a warning.
  UpdateResult apply(const torch::Tensor& loss, int64_t update);
  // Where the gradients of data-parallel replicas meet; a LocalReducer until set.
  void set_reducer(std::shared_ptr<distributed::GradientReducer> reducer);
  distributed::GradientReducer& reducer() { return *reducer_; }

 private:
  double clip_gradients();
  void step_optimizer();

  torch::optim::Optimizer& optimizer_;
  ModelPrecision& precision_;
  UpdateOptions options_;
  Ema* ema_;
  const torch::nn::Module* averaged_;
  std::shared_ptr<distributed::GradientReducer> reducer_;
  double clip_factor_ = 1.0;  // of this update's gradients, applied by the reducer to those it keeps
};

}  // namespace dalle::train
