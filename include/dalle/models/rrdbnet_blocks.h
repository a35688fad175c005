#pragma once
// The blocks of ESRGAN's generator as basicsr 1.4.2 lays them out
// (basicsr/archs/rrdbnet_arch.py), so that Real-ESRGAN's released weights load by name:
// a residual dense block is conv1..conv5, a residual-in-residual dense block is rdb1..rdb3.
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>

#include <cstdint>

namespace dalle::models {

// ESRGAN scales every residual branch by this before adding it back ("empirically 0.2").
inline constexpr double kRrdbResidualScale = 0.2;
// Negative slope of every LeakyReLU in the network.
inline constexpr double kRrdbLeakySlope = 0.2;

// Five densely connected 3x3 convs: conv_k reads the block's input and the outputs of
// conv_1..conv_(k-1), concatenated on channels; conv1..conv4 write `num_grow_ch` channels
// each, followed by LeakyReLU(0.2); conv5 writes `num_feat` channels, scaled by 0.2 and added
// to the input. Weights start as basicsr's: Kaiming normal times 0.1, zero biases.
class ResidualDenseBlockImpl : public torch::nn::Module {
 public:
  ResidualDenseBlockImpl(int64_t num_feat, int64_t num_grow_ch);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr}, conv3_{nullptr}, conv4_{nullptr}, conv5_{nullptr};
};
TORCH_MODULE(ResidualDenseBlock);

// Residual in residual: three dense blocks in a row, their result scaled by 0.2 and added
// to the input.
class RrdbImpl : public torch::nn::Module {
 public:
  RrdbImpl(int64_t num_feat, int64_t num_grow_ch);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  ResidualDenseBlock rdb1_{nullptr}, rdb2_{nullptr}, rdb3_{nullptr};
};
TORCH_MODULE(Rrdb);

}  // namespace dalle::models
