#include "dalle/models/clip_rerank.h"

#include <torch/torch.h>

#include <sstream>

#include "dalle/error.h"

namespace dalle::models {
namespace F = torch::nn::functional;

torch::Tensor clip_scores(Clip& model, const torch::Tensor& images, const torch::Tensor& tokens, int64_t batch_size) {
  if (batch_size < 1) throw Error("clip rerank: batch_size must be positive, got " + std::to_string(batch_size));
  if (images.dim() != 4 || images.size(0) < 1) {
    std::ostringstream got;
    got << images.sizes();
    throw Error("clip rerank: expected candidate images [N, 3, H, W] with N >= 1, got " + got.str());
  }
  const auto captions = tokens.dim() == 1 ? tokens.unsqueeze(0) : tokens;
  if (captions.dim() != 2 || captions.size(0) < 1) {
    throw Error("clip rerank: expected one caption's tokens, [L], or [T, L] for T renderings of it");
  }
  torch::NoGradGuard no_grad;
  const auto device = model->logit_scale.device();
  // ruclip's Predictor: the mean of the renderings' raw features, then normalised.
  const auto text = F::normalize(model->encode_text(captions.to(device)).mean(0, true),
                                 F::NormalizeFuncOptions().dim(-1));  // [1, D]
  std::vector<torch::Tensor> scores;
  for (int64_t start = 0; start < images.size(0); start += batch_size) {
    const auto chunk = images.slice(0, start, std::min(start + batch_size, images.size(0))).to(device);
    const auto features = model->encode_image(clip_preprocess(chunk, model->config()), true);
    scores.push_back(model->logit_scale.exp() * torch::matmul(features, text.t()).squeeze(1));
  }
  return torch::cat(scores).to(torch::kFloat32);
}

RerankResult top_k_scores(const torch::Tensor& scores, int64_t top_k) {
  if (scores.dim() != 1) throw Error("clip rerank: expected [N] scores");
  if (top_k < 1) throw Error("clip rerank: top_k must be positive, got " + std::to_string(top_k));
  const auto cpu = scores.detach().to(torch::kCPU, torch::kFloat64);
  // A stable descending sort: equal scores stay in index order.
  const auto order = std::get<1>(cpu.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
  const int64_t k = std::min(top_k, cpu.size(0));
  RerankResult result;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t index = order[i].item<int64_t>();
    result.indices.push_back(index);
    result.scores.push_back(cpu[index].item<double>());
  }
  return result;
}

RerankResult clip_rerank(Clip& model, const torch::Tensor& images, const torch::Tensor& tokens, int64_t top_k,
                         int64_t batch_size) {
  return top_k_scores(clip_scores(model, images, tokens, batch_size), top_k);
}

}  // namespace dalle::models
