#include "dalle/distributed/data_parallel.h"

#include <torch/torch.h>

#include "dalle/error.h"

namespace dalle::distributed {

DataParallelReducer::DataParallelReducer(std::shared_ptr<ProcessGroup> group, int64_t bucket_bytes)
    : group_(std::move(group)), bucket_bytes_(bucket_bytes) {
  if (!group_) throw Error("data parallel: no process group");
  if (bucket_bytes_ < 1) throw Error("data parallel: buckets of " + std::to_string(bucket_bytes_) + " bytes");
}

void DataParallelReducer::reduce(const std::vector<torch::Tensor>& parameters) {
  torch::NoGradGuard no_grad;
  // Which gradients some rank has: one small collective, so that every rank then makes the
  // same buckets in the same order.
  auto local = torch::empty({static_cast<int64_t>(parameters.size())}, torch::kFloat32);
  for (size_t i = 0; i < parameters.size(); ++i) local.data_ptr<float>()[i] = parameters[i].grad().defined() ? 1.0f : 0.0f;
  auto any = local.to(group_->device());
  group_->all_reduce(any, ReduceOp::max);
  ++collectives_;
  const auto defined = any.cpu();
  const auto* flag = defined.data_ptr<float>();

  std::vector<torch::Tensor> bucket;
  int64_t bucket_bytes = 0;
  const auto flush = [&] {
    if (!bucket.empty()) reduce_bucket(bucket);
    bucket.clear();
    bucket_bytes = 0;
  };
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (flag[i] == 0.0f) continue;
    auto parameter = parameters[i];
    if (!parameter.grad().defined()) parameter.mutable_grad() = torch::zeros_like(parameter);
    const auto& gradient = parameter.grad();
    // One bucket holds one dtype and one device, as one flat tensor does.
    if (!bucket.empty() && (bucket.front().scalar_type() != gradient.scalar_type() ||
                            bucket.front().device() != gradient.device())) {
      flush();
    }
    bucket.push_back(gradient);
    bucket_bytes += gradient.numel() * static_cast<int64_t>(gradient.element_size());
    if (bucket_bytes >= bucket_bytes_) flush();
  }
  flush();
}

void DataParallelReducer::reduce_bucket(const std::vector<torch::Tensor>& gradients) {
  bytes_reduced_ += average_together(*group_, gradients);
  ++collectives_;
}

int64_t average_together(ProcessGroup& group, const std::vector<torch::Tensor>& parts) {
  if (parts.empty()) return 0;
  std::vector<torch::Tensor> flat_parts;
  flat_parts.reserve(parts.size());
  for (const auto& part : parts) flat_parts.push_back(part.reshape({-1}));
  auto flat = torch::cat(flat_parts).to(group.device());
  group.all_reduce(flat, ReduceOp::average);
  int64_t offset = 0;
  for (const auto& part : parts) {
    const int64_t count = part.numel();
    part.copy_(flat.narrow(0, offset, count).view(part.sizes()));
    offset += count;
  }
  return flat.numel() * static_cast<int64_t>(flat.element_size());
}

torch::Tensor DataParallelReducer::agree(const torch::Tensor& flags) {
  auto agreed = flags.to(group_->device(), torch::kFloat32).contiguous();
  group_->all_reduce(agreed, ReduceOp::min);
  ++collectives_;
  return agreed.to(flags.device()).to(torch::kBool);
}

}  // namespace dalle::distributed
