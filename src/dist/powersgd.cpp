#include "dalle/dist/powersgd.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "dalle/error.h"

namespace dalle::dist {

namespace {

// A gradient as the matrix PowerSGD compresses: its first dimension by the rest.
std::pair<int64_t, int64_t> matrix_shape(const std::vector<int64_t>& shape) {
  int64_t rest = 1;
  for (size_t i = 1; i < shape.size(); ++i) rest *= shape[i];
  return {shape.empty() ? 1 : shape[0], rest};
}

// The orthonormal basis of P's columns, by Householder QR of P + 1e-6 I (stable where
// Gram-Schmidt is not, and defined when P is rank-deficient).
torch::Tensor orthogonalized(const torch::Tensor& p) {
  const auto regularized = p + 1e-6 * torch::eye(p.size(0), p.size(1), p.options());
  return std::get<0>(torch::linalg_qr(regularized, "reduced"));
}

// All-reduces the mean of every tensor of `parts` as one flat buffer, in place.
int64_t average_together(ProcessGroup& group, std::vector<torch::Tensor>& parts) {
  std::vector<torch::Tensor> flat;
  for (const auto& part : parts) flat.push_back(part.reshape({-1}));
  auto buffer = torch::cat(flat).to(group.device());
  group.all_reduce(buffer, ReduceOp::average);
  buffer = buffer.to(parts.front().device());
  int64_t offset = 0;
  for (auto& part : parts) {
    part = buffer.narrow(0, offset, part.numel()).view(part.sizes());
    offset += part.numel();
  }
  return buffer.numel() * static_cast<int64_t>(buffer.element_size());
}

}  // namespace

PowerSgdReducer::PowerSgdReducer(std::shared_ptr<ProcessGroup> group, PowerSgdOptions options)
    : group_(group), options_(options), whole_(std::move(group), options.bucket_bytes) {
  if (options_.rank < 1) throw Error("powersgd.rank must be at least 1");
}

bool PowerSgdReducer::compresses(const std::vector<int64_t>& shape, const PowerSgdOptions& options) {
  if (shape.size() < 2) return false;
  const auto [n, m] = matrix_shape(shape);
  return static_cast<double>(n) * static_cast<double>(m) >
         options.min_compression_rate * static_cast<double>((n + m) * options.rank);
}

int64_t PowerSgdReducer::values_sent(const std::vector<int64_t>& shape, const PowerSgdOptions& options) {
  const auto [n, m] = matrix_shape(shape);
  return compresses(shape, options) ? (n + m) * options.rank : n * m;
}

void PowerSgdReducer::reduce(const std::vector<torch::Tensor>& parameters) {
  torch::NoGradGuard no_grad;
  ++updates_;
  std::vector<torch::Tensor> whole, compressed;
  for (const auto& parameter : parameters) {
    const bool compress = updates_ >= options_.start_update && compresses(parameter.sizes().vec(), options_);
    if (compress && !parameter.grad().defined()) parameter.mutable_grad() = torch::zeros_like(parameter);
    (compress ? compressed : whole).push_back(parameter);
  }
  whole_.reduce(whole);
  if (!compressed.empty()) compress(compressed);
}

PowerSgdReducer::Matrix& PowerSgdReducer::state_of(const torch::Tensor& parameter, int64_t n, int64_t m) {
  auto found = matrices_.find(parameter.unsafeGetTensorImpl());
  if (found != matrices_.end()) return found->second;
  order_.push_back(parameter.unsafeGetTensorImpl());
  if (auto restored = restored_.find(order_.size() - 1); restored != restored_.end()) {
    if (restored->second.error.sizes() != torch::IntArrayRef({n, m})) {
      throw Error("the checkpoint's PowerSGD state does not fit the gradients (a " + std::to_string(n) + "x" +
                  std::to_string(m) + " matrix)");
    }
    const auto device = parameter.grad().device();
    Matrix matrix{restored->second.q.to(device), restored->second.error.to(device)};
    restored_.erase(restored);
    return matrices_.emplace(parameter.unsafeGetTensorImpl(), std::move(matrix)).first->second;
  }
  // The same Q on every replica: a generator of its own, seeded by the options and by the
  // order in which the matrices first come.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed + matrices_.size());
  const auto options = parameter.grad().options().dtype(torch::kFloat32);
  Matrix matrix{torch::randn({m, options_.rank}, generator, torch::kFloat32).to(options.device()),
                torch::zeros({n, m}, options)};
  return matrices_.emplace(parameter.unsafeGetTensorImpl(), std::move(matrix)).first->second;
}

void PowerSgdReducer::save_state(io::TensorMap& state, const std::string& prefix) {
  state[prefix + "updates"] = torch::tensor(updates_, torch::kInt64);
  for (size_t i = 0; i < order_.size(); ++i) {
    const auto& matrix = matrices_.at(order_[i]);
    auto error = matrix.error.to(group_->device()).contiguous();
    group_->all_reduce(error, ReduceOp::average);
    state[prefix + "error." + std::to_string(i)] = error.cpu();
    state[prefix + "q." + std::to_string(i)] = matrix.q.cpu();
  }
}

void PowerSgdReducer::load_state(const io::TensorMap& state, const std::string& prefix) {
  const auto updates = state.find(prefix + "updates");
  if (updates == state.end()) return;  // a checkpoint of another reduction: start afresh
  updates_ = updates->second.item<int64_t>();
  for (size_t i = 0;; ++i) {
    const auto error = state.find(prefix + "error." + std::to_string(i));
    const auto q = state.find(prefix + "q." + std::to_string(i));
    if (error == state.end() || q == state.end()) break;
    restored_[i] = Matrix{q->second, error->second};
  }
}

void PowerSgdReducer::compress(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> ms, ps, qs;
  std::vector<Matrix*> states;
  for (const auto& parameter : parameters) {
    const auto [n, m] = matrix_shape(parameter.sizes().vec());
    auto& state = state_of(parameter, n, m);
    // Error feedback: what earlier updates dropped joins this one; a buffer that holds
    // non-finite values (an overflowed fp16 update) starts again from zero.
    if (!torch::isfinite(state.error).all().item<bool>()) state.error.zero_();
    auto matrix = parameter.grad().reshape({n, m}).to(torch::kFloat32) + state.error;
    ps.push_back(matrix.mm(state.q));
    ms.push_back(std::move(matrix));
    states.push_back(&state);
  }
  bytes_compressed_ += average_together(*group_, ps);
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i] = orthogonalized(ps[i]);
    qs.push_back(ms[i].t().mm(ps[i]));
  }
  bytes_compressed_ += average_together(*group_, qs);
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto decompressed = ps[i].mm(qs[i].t());
    states[i]->error = ms[i] - decompressed;
    if (options_.warm_start) states[i]->q = qs[i].clone();
    parameters[i].grad().copy_(decompressed.view_as(parameters[i].grad()));
  }
}

}  // namespace dalle::dist
