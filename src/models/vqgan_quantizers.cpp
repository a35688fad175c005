#include "dalle/models/vqgan_quantizers.h"

#include <torch/torch.h>

#include "dalle/error.h"
#include "dalle/models/dvae_objective.h"

namespace dalle::models {
namespace F = torch::nn::functional;

namespace {

// [B, h, w, D] rows -> [B, D, h, w]
torch::Tensor channels_first(const torch::Tensor& rows) { return rows.permute({0, 3, 1, 2}).contiguous(); }

}  // namespace

GumbelQuantizerImpl::GumbelQuantizerImpl(int64_t in, int64_t codes, int64_t dim) {
  proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, codes, 1)));
  embed = register_module("embed", torch::nn::Embedding(codes, dim));
}

torch::Tensor GumbelQuantizerImpl::logits(const torch::Tensor& z) { return proj->forward(z); }

Quantized GumbelQuantizerImpl::forward(const torch::Tensor& z, double temperature,
                                       std::optional<at::Generator> generator) {
  const auto scores = logits(z);
  const auto soft = gumbel_softmax(scores, temperature, std::move(generator));
  const auto tokens = soft.argmax(1);
  const auto hard = torch::zeros_like(soft).scatter_(1, tokens.unsqueeze(1), 1.0);
  // One-hot in the forward pass, the relaxed sample's gradient in the backward pass.
  const auto one_hot = hard - soft.detach() + soft;
  Quantized out;
  out.codes = torch::einsum("bnhw,nd->bdhw", {one_hot, embed->weight});
  out.tokens = tokens;
  out.kl = kl_to_uniform(scores);
  return out;
}

torch::Tensor GumbelQuantizerImpl::lookup(const torch::Tensor& tokens) {
  return channels_first(embed->forward(tokens));
}

VectorQuantizerImpl::VectorQuantizerImpl(int64_t codes, int64_t dim) {
  embedding = register_module("embedding", torch::nn::Embedding(codes, dim));
  // taming's initialisation: small codes, so that early encoder outputs all find one.
  torch::NoGradGuard no_grad;
  embedding->weight.uniform_(-1.0 / static_cast<double>(codes), 1.0 / static_cast<double>(codes));
}

torch::Tensor VectorQuantizerImpl::nearest(const torch::Tensor& z) {
  const auto& codes = embedding->weight;
  if (z.dim() != 4 || z.size(1) != codes.size(1)) {
    throw Error("vector quantizer: expected [batch, " + std::to_string(codes.size(1)) + ", h, w] latents");
  }
  const auto rows = z.permute({0, 2, 3, 1}).reshape({-1, codes.size(1)});
  // |z - e|^2 = |z|^2 + |e|^2 - 2 z.e, as taming computes it, so that near-ties break alike.
  const auto distances = rows.pow(2).sum(1, true) + codes.pow(2).sum(1) - 2 * torch::matmul(rows, codes.t());
  return distances.argmin(1).reshape({z.size(0), z.size(2), z.size(3)});
}

Quantized VectorQuantizerImpl::forward(const torch::Tensor& z) {
  Quantized out;
  out.tokens = nearest(z);
  const auto quantized = lookup(out.tokens);
  out.codebook = F::mse_loss(quantized, z.detach());
  out.commitment = F::mse_loss(z, quantized.detach());
  out.codes = z + (quantized - z).detach();
  return out;
}

torch::Tensor VectorQuantizerImpl::lookup(const torch::Tensor& tokens) {
  return channels_first(embedding->forward(tokens));
}

torch::Tensor VectorQuantizerImpl::restart_unused(const torch::Tensor& usage, const torch::Tensor& z,
                                                  at::Generator generator) {
  auto& codes = embedding->weight;
  const auto unused = (usage.to(torch::kCPU) == 0).nonzero().flatten();
  const int64_t count = unused.numel();
  if (count == 0) return unused;
  const auto rows = z.detach().permute({0, 2, 3, 1}).reshape({-1, codes.size(1)});
  const auto picks = torch::randint(rows.size(0), {count}, generator,
                                    torch::TensorOptions().dtype(torch::kInt64).device(rows.device()));
  torch::NoGradGuard no_grad;
  codes.index_copy_(0, unused.to(codes.device()), rows.index_select(0, picks.to(rows.device())).to(codes.dtype()));
  return unused;
}

}  // namespace dalle::models
