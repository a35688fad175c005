#pragma once
// The prior families' linear layer: torch::nn::Linear's parameters under its names (`weight`
// [out, in], `bias` [out]), so that checkpoints load by name, with a second way to run it for
// inference on the CPU: the weight as int8 with a scale per output channel, multiplied by
// FBGEMM's dynamic-quantized product in LibTorch (each call quantizes its activations, the
// product accumulates in int32 and comes out in float32).
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>

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

  torch::Tensor weight, bias;

 private:
  struct Int8Weight;
  int64_t in_features_, out_features_;
  bool has_bias_;
  std::shared_ptr<Int8Weight> packed_;
};
TORCH_MODULE(Linear);

// Quantizes every models::Linear under `module` (quantize_int8) and returns how many; the
// module must be float32 on the CPU.
int64_t quantize_linears_int8(torch::nn::Module& module);

}  // namespace dalle::models
