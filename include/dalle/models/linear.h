#pragma once
// The prior families' linear layer: torch::nn::Linear's parameters under its names (`weight`
// [out, in], `bias` [out]), so that checkpoints load by name, with a second way to run it for
// inference on the CPU: the weight as int8 with a scale per output channel, multiplied by
// FBGEMM's dynamic-quantized product in LibTorch (each call quantizes its activations, the
// product accumulates in int32 and comes out in float32). For fine-tuning it can carry a
// low-rank adapter (LoRA, Hu et al. 2021) beside its weight.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace dalle::models {

class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true);
  // As torch::nn::Linear's: Kaiming-uniform weight, uniform bias in +-1/sqrt(in).
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);

  // Replaces the float32 weight by its int8 form (symmetric, a scale per output row): a
  // quarter of its memory; from then on the layer runs float32 inputs on the CPU only, and
  // holds no `weight` to train, save or move.
  void quantize_int8();
  bool quantized() const { return packed_ != nullptr; }

  // Adds a low-rank adapter: forward then adds scale * B(A(x)), with A [rank, in] and B
  // [out, rank] registered as `lora_A.weight` and `lora_B.weight` (peft's names), on the
  // weight's device, in `type` (by default the weight's). A starts as peft's
  // (Kaiming-uniform), B at zero, so that the layer computes what it did until training moves B.
  void add_adapter(int64_t rank, double scale, std::optional<torch::ScalarType> type = std::nullopt);
  bool adapted() const { return !lora_A.is_empty(); }
  double adapter_scale() const { return adapter_scale_; }
  // weight += scale * B A, rounded once to the weight's dtype; the adapter goes.
  void merge_adapter();

  torch::Tensor weight, bias;
  torch::nn::Linear lora_A{nullptr}, lora_B{nullptr};

 private:
  struct Int8Weight;
  int64_t in_features_, out_features_;
  bool has_bias_;
  double adapter_scale_ = 0;
  std::shared_ptr<Int8Weight> packed_;
};
TORCH_MODULE(Linear);

// Quantizes every models::Linear under `module` (quantize_int8) and returns how many; the
// module must be float32 on the CPU.
int64_t quantize_linears_int8(torch::nn::Module& module);

}  // namespace dalle::models
