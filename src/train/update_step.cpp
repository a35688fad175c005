#include "dalle/train/update_step.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "dalle/error.h"
#include "dalle/log.h"

namespace dalle::train {

UpdateStep::UpdateStep(torch::optim::Optimizer& optimizer, ModelPrecision& precision, UpdateOptions options,
                       Ema* ema, const torch::nn::Module* averaged)
    : optimizer_(optimizer),
      precision_(precision),
      options_(std::move(options)),
      ema_(ema),
      averaged_(averaged),
      reducer_(std::make_shared<distributed::LocalReducer>()) {
  if ((ema_ == nullptr) != (averaged_ == nullptr)) {
    throw Error(options_.what + ": an update step's moving average needs both the average and its module");
  }
}

void UpdateStep::set_reducer(std::shared_ptr<distributed::GradientReducer> reducer) {
  if (!reducer) throw Error(options_.what + ": an update step needs a gradient reducer");
  reducer_ = std::move(reducer);
}

// As torch's clip_grad_norm_, with the norm of the whole model as the reducer measures it.
double UpdateStep::clip_gradients() {
  if (options_.grad_clip <= 0 && !options_.measure_norm) return 0;
  const auto& parameters = precision_.parameters();
  const double norm = reducer_->gradient_norm(parameters);
  if (options_.grad_clip > 0 && std::isfinite(norm)) {
    const double factor = std::min(1.0, options_.grad_clip / (norm + 1e-6));
    torch::NoGradGuard no_grad;
    for (const auto& parameter : parameters) {
      if (parameter.grad().defined()) parameter.grad().mul_(factor);
    }
  }
  return norm;
}

UpdateResult UpdateStep::apply(const torch::Tensor& loss, int64_t update) {
  optimizer_.zero_grad();
  reducer_->before_backward(precision_.parameters());
  precision_.scaled(loss).backward();
  // Averaging commutes with the fp16 scales, so what backward started averaging finishes
  // first; what must see true gradients (PowerSGD's error feedback would otherwise carry one
  // update's scale into the next) is reduced after unscaling, and only for an update taken.
  reducer_->reduce_scaled(precision_.parameters());
  const auto finite = reducer_->agree(precision_.finite_flags());
  UpdateResult result;
  if (precision_.unscale_and_update(finite)) {
    reducer_->reduce_unscaled(precision_.parameters());
    result.grad_norm = clip_gradients();
  } else {
    result.grad_norm = std::nan("");
  }
  // A norm that overflows is as unusable as a non-finite gradient.
  result.skipped = !std::isfinite(result.grad_norm);
  if (result.skipped) {
    log::warn(options_.what, ": gradients not finite at update ", update, "; the update is skipped");
    return result;
  }
  optimizer_.step();
  if (options_.after_step) options_.after_step();
  if (ema_) ema_->update(*averaged_);
  return result;
}

}  // namespace dalle::train
