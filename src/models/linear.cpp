#include "dalle/models/linear.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/nn/init.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>

#include "dalle/error.h"

namespace dalle::models {

struct LinearImpl::Int8Weight {
  c10::intrusive_ptr<LinearPackedParamsBase> packed;
};

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool bias)
    : in_features_(in_features), out_features_(out_features), has_bias_(bias) {
  reset();
}

void LinearImpl::reset() {
  packed_.reset();
  weight = register_parameter("weight", torch::empty({out_features_, in_features_}));
  bias = has_bias_ ? register_parameter("bias", torch::empty({out_features_})) : torch::Tensor();
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (has_bias_) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features_));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  if (adapted()) return torch::linear(x, weight, bias) + lora_B(lora_A(x)) * adapter_scale_;
  if (!packed_) return torch::linear(x, weight, bias);
  if (!x.device().is_cpu() || x.scalar_type() != torch::kFloat32) {
    throw Error("an int8 linear layer takes float32 inputs on the CPU, not " + std::string(c10::toString(x.scalar_type())) +
                " on " + x.device().str());
  }
  auto sizes = x.sizes().vec();
  sizes.back() = out_features_;
  // reduce_range: 7-bit activations, so that FBGEMM's 16-bit intermediate sums cannot saturate
  // on CPUs without VNNI (PyTorch's dynamic quantization does the same on x86).
  return packed_->packed->apply_dynamic(x.reshape({-1, in_features_}).contiguous(), /*reduce_range=*/true)
      .view(sizes);
}

void LinearImpl::add_adapter(int64_t rank, double scale, std::optional<torch::ScalarType> type) {
  if (adapted()) throw Error("this linear layer has an adapter already; merge it first");
  if (packed_) throw Error("an int8 linear layer takes no adapter; add adapters before quantizing");
  if (rank < 1 || rank > std::min(in_features_, out_features_)) {
    throw Error("adapter rank " + std::to_string(rank) + " does not fit a " + std::to_string(in_features_) + " -> " +
                std::to_string(out_features_) + " linear layer (1 to the smaller side)");
  }
  const auto options = torch::nn::LinearOptions(in_features_, rank).bias(false);
  lora_A = register_module("lora_A", torch::nn::Linear(options));
  lora_B = register_module("lora_B", torch::nn::Linear(torch::nn::LinearOptions(rank, out_features_).bias(false)));
  torch::NoGradGuard no_grad;
  lora_B->weight.zero_();
  lora_A->to(weight.device(), type.value_or(weight.scalar_type()));
  lora_B->to(weight.device(), type.value_or(weight.scalar_type()));
  adapter_scale_ = scale;
}

void LinearImpl::merge_adapter() {
  if (!adapted()) return;
  {
    torch::NoGradGuard no_grad;
    const auto delta = torch::matmul(lora_B->weight.to(torch::kFloat32), lora_A->weight.to(torch::kFloat32));
    weight.copy_(weight.to(torch::kFloat32) + delta * adapter_scale_);
  }
  unregister_module("lora_A");
  unregister_module("lora_B");
  lora_A = nullptr;
  lora_B = nullptr;
  adapter_scale_ = 0;
}

void LinearImpl::quantize_int8() {
  if (packed_) return;
  if (adapted()) throw Error("merge the adapter into the weight before quantizing (models::merge_adapters)");
  if (!weight.device().is_cpu() || weight.scalar_type() != torch::kFloat32) {
    throw Error("int8 weights are made from float32 ones on the CPU, not " +
                std::string(c10::toString(weight.scalar_type())) + " on " + weight.device().str());
  }
  torch::NoGradGuard no_grad;
  const auto scales = (weight.abs().amax(1) / 127.0).clamp_min(1e-12).to(torch::kFloat64);
  const auto zero_points = torch::zeros({out_features_}, torch::kInt64);
  const auto int8_weight = torch::quantize_per_channel(weight, scales, zero_points, 0, torch::kQInt8);
  static const auto prepack =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("quantized::linear_prepack", "")
          .typed<c10::intrusive_ptr<LinearPackedParamsBase>(at::Tensor, std::optional<at::Tensor>)>();
  packed_ = std::make_shared<Int8Weight>(
      Int8Weight{prepack.call(int8_weight, has_bias_ ? std::optional<at::Tensor>(bias.detach().clone()) : std::nullopt)});
  // The float weight goes (the registered parameter shares its storage): the packed one is all
  // the layer reads.
  weight.set_requires_grad(false);
  weight.set_data(torch::empty({0}));
}

int64_t quantize_linears_int8(torch::nn::Module& module) {
  int64_t count = 0;
  for (const auto& child : module.modules(/*include_self=*/true)) {
    if (auto* linear = dynamic_cast<LinearImpl*>(child.get())) {
      linear->quantize_int8();
      ++count;
    }
  }
  return count;
}

}  // namespace dalle::models
