#include "dalle/distributed/powersgd.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Half.h>
#include <torch/torch.h>

#include <cmath>
#include <unordered_set>

#include "dalle/error.h"

namespace dalle::distributed {

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

// `values` (fp32) in `dtype`; in 16 bits, infinities are clamped to the largest finite value
// (NaN stays NaN, and marks the buffer for zeroing).
torch::Tensor stored_as(const torch::Tensor& values, torch::ScalarType dtype) {
  if (dtype == torch::kFloat32) return values;
  const double largest = dtype == torch::kHalf ? 65504.0 : static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
  return values.clamp(-largest, largest).to(dtype);
}

}  // namespace

bool compresses(int64_t rows, int64_t columns, const PowerSgdOptions& options) {
  return static_cast<double>(rows) * static_cast<double>(columns) >
         options.min_compression_rate * static_cast<double>((rows + columns) * options.rank);
}

bool compresses(const std::vector<int64_t>& shape, const PowerSgdOptions& options) {
  if (shape.size() < 2) return false;
  const auto [n, m] = matrix_shape(shape);
  return compresses(n, m, options);
}

int64_t values_sent(const std::vector<int64_t>& shape, const PowerSgdOptions& options) {
  const auto [n, m] = matrix_shape(shape);
  return compresses(shape, options) ? (n + m) * effective_rank(n, m, options) : n * m;
}

int64_t effective_rank(int64_t rows, int64_t columns, const PowerSgdOptions& options) {
  return std::min({options.rank, rows, columns});
}

torch::ScalarType q_dtype(const PowerSgdOptions& options) {
  return options.warm_start ? torch::kFloat32 : options.dtype;
}

torch::Tensor initial_q(const PowerSgdOptions& options, int64_t slot, int64_t rows, int64_t columns,
                        torch::Device device) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.seed + static_cast<uint64_t>(slot));
  return torch::randn({columns, effective_rank(rows, columns, options)}, generator, torch::kFloat32)
      .to(device, q_dtype(options));
}

LowRankAverager::LowRankAverager(std::shared_ptr<ProcessGroup> group, const PowerSgdOptions& options)
    : group_(std::move(group)), options_(options) {
  if (options_.rank < 1) throw Error("powersgd.rank must be at least 1");
  if (options_.dtype != torch::kFloat32 && options_.dtype != torch::kBFloat16 && options_.dtype != torch::kHalf) {
    throw Error("powersgd.dtype must be float32, bfloat16 or float16");
  }
}

torch::Tensor LowRankAverage::decompressed() const { return p.mm(q.to(torch::kFloat32).t()); }

double LowRankAverager::average(const std::vector<torch::Tensor>& gradients, const std::vector<LowRankState*>& states) {
  if (gradients.empty()) return 0.0;
  torch::NoGradGuard no_grad;
  // What earlier updates dropped joins this one; a buffer that holds non-finite values
  // starts again from zero. (The flags are read together: one synchronisation on a GPU.)
  std::vector<torch::Tensor> finite;
  for (const auto* state : states) finite.push_back(torch::isfinite(state->error).all());
  const auto flags = torch::stack(finite).cpu();
  const bool* is_finite = flags.data_ptr<bool>();
  for (size_t i = 0; i < gradients.size(); ++i) {
    auto& error = states[i]->error;
    if (!is_finite[i]) error.zero_();
    if (options_.dtype == torch::kFloat32) {
      error.add_(gradients[i]);
    } else {
      error.copy_(stored_as(error.to(torch::kFloat32) + gradients[i], options_.dtype));
    }
  }
  double square = 0;
  const auto averages = compress(states, square);
  for (size_t i = 0; i < gradients.size(); ++i) {
    const auto decompressed = averages[i].decompressed();
    drop_from_error(*states[i], decompressed);
    gradients[i].copy_(decompressed);
  }
  return square;
}

std::vector<LowRankAverage> LowRankAverager::compress(const std::vector<LowRankState*>& states, double& square) {
  std::vector<LowRankAverage> averages(states.size());
  if (states.empty()) return averages;
  torch::NoGradGuard no_grad;
  const auto dtype = options_.dtype;
  // A 16-bit buffer is read back in float32 where it is used, one matrix at a time, never
  // all at once (DALL-E's 12B would hold 5.6 GiB of such copies per GPU).
  const auto in_float32 = [&](size_t i) { return states[i]->error.to(torch::kFloat32); };
  std::vector<torch::Tensor> ps, qs;
  for (size_t i = 0; i < states.size(); ++i) {
    ps.push_back(stored_as(in_float32(i).mm(states[i]->q.to(torch::kFloat32)), dtype));
  }
  bytes_ += average_together(*group_, ps);
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i] = orthogonalized(ps[i].to(torch::kFloat32));
    qs.push_back(stored_as(in_float32(i).t().mm(ps[i]), dtype));
  }
  bytes_ += average_together(*group_, qs);
  auto sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(states.front()->error.device()));
  for (size_t i = 0; i < states.size(); ++i) {
    if (options_.warm_start) states[i]->q.copy_(qs[i]);
    sum += qs[i].to(torch::kFloat32).square().sum().to(sum.device(), torch::kFloat64);
    averages[i] = {std::move(ps[i]), std::move(qs[i])};
  }
  square += sum.item<double>();
  return averages;
}

void LowRankAverager::drop_from_error(LowRankState& state, const torch::Tensor& decompressed) const {
  torch::NoGradGuard no_grad;
  state.error.copy_(stored_as(state.error.to(torch::kFloat32) - decompressed, options_.dtype));
}

PowerSgdReducer::PowerSgdReducer(std::shared_ptr<ProcessGroup> group, PowerSgdOptions options, bool overlap)
    : group_(group),
      options_(options),
      whole_(group, options.bucket_bytes, overlap),
      low_rank_(std::move(group), options) {}

std::vector<torch::Tensor> PowerSgdReducer::never_compressed(const std::vector<torch::Tensor>& parameters) const {
  std::vector<torch::Tensor> whole;
  for (const auto& parameter : parameters) {
    if (!compresses(parameter.sizes().vec(), options_)) whole.push_back(parameter);
  }
  return whole;
}

void PowerSgdReducer::before_backward(const std::vector<torch::Tensor>& parameters) {
  whole_.before_backward(never_compressed(parameters));
}

// What is never compressed carries no error feedback: it rides the buckets of backward.
void PowerSgdReducer::reduce_scaled(const std::vector<torch::Tensor>& parameters) {
  whole_.reduce_scaled(never_compressed(parameters));
}

void PowerSgdReducer::reduce_unscaled(const std::vector<torch::Tensor>& parameters) {
  torch::NoGradGuard no_grad;
  // An update is a reduction of the parameters that came first: a second model stepping
  // with this reducer (the VQGAN's discriminator) does not count its own.
  compressed_.clear();
  if (parameters.empty()) return;
  if (!first_parameter_) first_parameter_ = parameters.front().unsafeGetTensorImpl();
  if (parameters.front().unsafeGetTensorImpl() == first_parameter_) ++updates_;
  std::vector<torch::Tensor> compressible;
  for (const auto& parameter : parameters) {
    if (compresses(parameter.sizes().vec(), options_)) compressible.push_back(parameter);
  }
  if (updates_ < options_.start_update) {
    whole_.reduce(compressible);
    return;
  }
  compressed_ = std::move(compressible);
  std::vector<torch::Tensor> matrices;
  std::vector<LowRankState*> states;
  for (auto& parameter : compressed_) {
    if (!parameter.grad().defined() || !parameter.grad().is_contiguous()) {
      parameter.mutable_grad() = parameter.grad().defined() ? parameter.grad().contiguous() : torch::zeros_like(parameter);
    }
    const auto [n, m] = matrix_shape(parameter.sizes().vec());
    matrices.push_back(parameter.grad().view({n, m}));
    states.push_back(&state_of(parameter, n, m));
  }
  compressed_square_ = low_rank_.average(matrices, states);
}

double PowerSgdReducer::gradient_norm(const std::vector<torch::Tensor>& parameters) {
  if (compressed_.empty()) return GradientReducer::gradient_norm(parameters);
  std::unordered_set<const torch::TensorImpl*> compressed;
  for (const auto& parameter : compressed_) compressed.insert(parameter.unsafeGetTensorImpl());
  std::vector<torch::Tensor> whole;
  for (const auto& parameter : parameters) {
    if (!compressed.count(parameter.unsafeGetTensorImpl())) whole.push_back(parameter);
  }
  const double whole_norm = GradientReducer::gradient_norm(whole);
  return std::sqrt(whole_norm * whole_norm + compressed_square_);
}

LowRankState& PowerSgdReducer::state_of(const torch::Tensor& parameter, int64_t n, int64_t m) {
  auto found = matrices_.find(parameter.unsafeGetTensorImpl());
  if (found != matrices_.end()) return found->second;
  const int64_t slot = static_cast<int64_t>(order_.size());
  order_.push_back(parameter.unsafeGetTensorImpl());
  const auto device = parameter.grad().device();
  LowRankState state;
  if (auto restored = restored_.find(slot); restored != restored_.end()) {
    if (restored->second.error.sizes() != torch::IntArrayRef({n, m})) {
      throw Error("the checkpoint's PowerSGD state does not fit the gradients (a " + std::to_string(n) + "x" +
                  std::to_string(m) + " matrix)");
    }
    // A Q of another rank (powersgd.rank changed on resume) starts afresh.
    const auto& q = restored->second.q;
    state = {q.size(1) == effective_rank(n, m, options_) ? q.to(device, q_dtype(options_))
                                                          : initial_q(options_, slot, n, m, device),
             restored->second.error.to(device, options_.dtype)};
    restored_.erase(restored);
  } else {
    state = {initial_q(options_, slot, n, m, device), torch::zeros({n, m}, torch::TensorOptions().dtype(options_.dtype).device(device))};
  }
  return matrices_.emplace(parameter.unsafeGetTensorImpl(), std::move(state)).first->second;
}

void PowerSgdReducer::save_state(io::TensorMap& state, const std::string& prefix) {
  whole_.save_state(state, prefix + "whole.");
  state[prefix + "updates"] = torch::tensor(updates_, torch::kInt64);
  for (size_t i = 0; i < order_.size(); ++i) {
    const auto& matrix = matrices_.at(order_[i]);
    auto error = matrix.error.to(group_->device(), torch::kFloat32).contiguous();
    group_->all_reduce(error, ReduceOp::average);
    state[prefix + "error." + std::to_string(i)] = error.cpu();
    state[prefix + "q." + std::to_string(i)] = matrix.q.cpu();
  }
}

void PowerSgdReducer::load_state(const io::TensorMap& state, const std::string& prefix) {
  whole_.load_state(state, prefix + "whole.");
  const auto updates = state.find(prefix + "updates");
  if (updates == state.end()) return;  // a checkpoint of another reduction: start afresh
  updates_ = updates->second.item<int64_t>();
  for (size_t i = 0;; ++i) {
    const auto error = state.find(prefix + "error." + std::to_string(i));
    const auto q = state.find(prefix + "q." + std::to_string(i));
    if (error == state.end() || q == state.end()) break;
    restored_[i] = LowRankState{q->second, error->second};
  }
}

}  // namespace dalle::distributed
