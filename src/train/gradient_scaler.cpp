#include "dalle/train/gradient_scaler.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "dalle/error.h"

namespace dalle::train {

GradientScaler::GradientScaler(GradientScalingConfig config, std::vector<std::vector<torch::Tensor>> groups,
                               int64_t replicas)
    : config_(config),
      groups_(std::move(groups)),
      offset_log2_(std::log2(static_cast<double>(std::max<int64_t>(replicas, 1)))),
      log2_scales_(groups_.size(), config.initial_log2 + offset_log2_),
      last_backoff_(groups_.size(), -1) {
  config_.validate();
}

double GradientScaler::scale(size_t group) const { return std::exp2(log2_scales_.at(group)); }

ScaleSummary GradientScaler::summary() const {
  if (log2_scales_.empty()) return {};
  auto sorted = log2_scales_;
  std::sort(sorted.begin(), sorted.end());
  return {std::exp2(sorted.front()), std::exp2(sorted[sorted.size() / 2]), std::exp2(sorted.back())};
}

void GradientScaler::scale_held_gradients() {
  torch::NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::vector<torch::Tensor> gradients;
    for (const auto& parameter : groups_[g]) {
      if (parameter.grad().defined()) gradients.push_back(parameter.grad());
    }
    if (!gradients.empty()) torch::_foreach_mul_(gradients, scale(g));
  }
}

torch::Tensor GradientScaler::finite_flags() const {
  // Stacked on the gradients' device, so that a GPU synchronises once.
  std::vector<torch::Tensor> flags;
  for (const auto& group : groups_) {
    std::vector<torch::Tensor> finite;
    for (const auto& parameter : group) {
      if (parameter.grad().defined()) finite.push_back(torch::isfinite(parameter.grad()).all());
    }
    flags.push_back(finite.empty() ? torch::tensor(true) : torch::stack(finite).all());
  }
  if (flags.empty()) return torch::ones({0}, torch::kBool);
  for (auto& flag : flags) flag = flag.to(flags.front().device());
  return torch::stack(flags);
}

bool GradientScaler::unscale_and_update(const torch::Tensor& finite_flags) {
  if (finite_flags.numel() != static_cast<int64_t>(groups_.size())) {
    throw Error("gradient scaler: " + std::to_string(finite_flags.numel()) + " finite flags for " +
                std::to_string(groups_.size()) + " scale groups");
  }
  const auto flags = finite_flags.to(torch::kCPU, torch::kBool).contiguous();
  std::vector<bool> finite(flags.data_ptr<bool>(), flags.data_ptr<bool>() + flags.numel());
  const bool step = std::all_of(finite.begin(), finite.end(), [](bool f) { return f; });
  torch::NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::vector<torch::Tensor> gradients;
    for (const auto& parameter : groups_[g]) {
      if (parameter.grad().defined()) gradients.push_back(parameter.grad());
    }
    if (gradients.empty()) continue;
    // One fused launch per group rather than one per tensor.
    if (step) {
      torch::_foreach_div_(gradients, scale(g));
    } else {
      torch::_foreach_zero_(gradients);
    }
  }
  const double low = config_.min_log2 + offset_log2_, high = config_.max_log2 + offset_log2_;
  for (size_t g = 0; g < groups_.size(); ++g) {
    double& log2_scale = log2_scales_[g];
    if (finite[g]) {
      log2_scale += config_.growth_log2;
    } else if (last_backoff_[g] < 0 || updates_ - last_backoff_[g] >= config_.backoff_interval) {
      log2_scale -= config_.backoff_log2;
      last_backoff_[g] = updates_;
    }
    log2_scale = std::clamp(log2_scale, low, high);
  }
  ++updates_;
  if (!step) ++skipped_;
  return step;
}

io::TensorMap GradientScaler::state() const {
  auto options = torch::TensorOptions().dtype(torch::kFloat64);
  return {{"log2_scales", torch::tensor(log2_scales_, options)},
          {"last_backoff", torch::tensor(last_backoff_, torch::kInt64)},
          {"counters", torch::tensor({updates_, skipped_}, torch::kInt64)}};
}

void GradientScaler::load_state(const io::TensorMap& state) {
  const auto scales = state.find("log2_scales"), last_backoff = state.find("last_backoff"),
             counters = state.find("counters");
  if (scales == state.end() || last_backoff == state.end() || counters == state.end() ||
      scales->second.numel() != static_cast<int64_t>(groups_.size()) ||
      last_backoff->second.numel() != static_cast<int64_t>(groups_.size()) || counters->second.numel() != 2) {
    throw Error("the checkpoint's gradient scales do not fit: expected " + std::to_string(groups_.size()) +
                " scales with their backoff history");
  }
  const auto s = scales->second.to(torch::kFloat64).contiguous();
  const auto b = last_backoff->second.to(torch::kInt64).contiguous();
  log2_scales_.assign(s.data_ptr<double>(), s.data_ptr<double>() + s.numel());
  last_backoff_.assign(b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + b.numel());
  updates_ = counters->second[0].item<int64_t>();
  skipped_ = counters->second[1].item<int64_t>();
}

}  // namespace dalle::train
