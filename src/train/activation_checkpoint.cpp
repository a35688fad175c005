#include "dalle/train/activation_checkpoint.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "dalle/train/precision.h"

namespace dalle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the recomputation needs, carried through the autograd context.
struct Recompute : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> fn;
  ForwardState state;
  torch::ScalarType kept_as = torch::kFloat32, input_type = torch::kFloat32;
};

torch::Tensor generator_state(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_generator_state(at::Generator& generator, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

class Checkpointed : public torch::autograd::Function<Checkpointed> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               c10::intrusive_ptr<Recompute> recompute) {
    recompute->state = ForwardState(x);
    recompute->input_type = x.scalar_type();
    ctx->save_for_backward({kept_input(x, recompute->kept_as)});
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(recompute);
    torch::NoGradGuard no_grad;
    return recompute->fn(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const auto input = recomputation_input(ctx->get_saved_variables()[0], recompute->input_type);
    torch::autograd::backward({recompute->state.rerun(recompute->fn, input)}, {grads[0]});
    return {input.grad(), torch::Tensor()};
  }
};

}  // namespace

ForwardState::ForwardState(const torch::Tensor& x)
    : generator_(at::globalContext().defaultGenerator(x.device())), generator_state_(generator_state(generator_)) {
  const auto device = x.device().type();
  if (at::autocast::is_autocast_enabled(device)) autocast_ = at::autocast::get_autocast_dtype(device);
}

torch::Tensor ForwardState::rerun(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                                  const torch::Tensor& input) {
  const auto after_forward = generator_state(generator_);
  set_generator_state(generator_, generator_state_);
  torch::Tensor output;
  {
    torch::AutoGradMode grad_mode(true);
    AutocastGuard autocast(input.device().type(), autocast_);
    output = fn(input);
  }
  set_generator_state(generator_, after_forward);
  return output;
}

torch::Tensor kept_input(const torch::Tensor& x, torch::ScalarType kept_as) {
  if (x.scalar_type() == kept_as || !x.is_floating_point()) return x;
  return x.detach().to(kept_as);
}

torch::Tensor recomputation_input(const torch::Tensor& kept, torch::ScalarType type) {
  return kept.detach().to(type).requires_grad_(true);
}

torch::Tensor checkpointed(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& x,
                           torch::ScalarType kept_as) {
  if (!torch::GradMode::is_enabled()) return fn(x);
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->fn = fn;
  recompute->kept_as = kept_as;
  // An input that needs no gradient (the first block behind frozen embeddings) becomes a leaf
  // that requires one: else the output would require none, and fn's parameters get none.
  return Checkpointed::apply(x.requires_grad() ? x : x.detach().requires_grad_(true), recompute);
}

}  // namespace dalle::train
