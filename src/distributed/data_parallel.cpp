#include "dalle/distributed/data_parallel.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <mutex>
#include <numeric>

#include "dalle/error.h"

namespace dalle::distributed {

struct DataParallelReducer::Attached {
  DataParallelReducer* reducer;
  std::vector<torch::Tensor> parameters;
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> bucket_of;
  bool reordered = false;  // the buckets follow rank 0's first backward
  bool armed = false;      // between before_backward and reduce_scaled: the hooks count
  // Hooks run on autograd's threads (one per device), the reduction on the caller's.
  std::mutex mutex;
  // This backward: which gradients came, in what order, how many each bucket still waits
  // for, the next bucket to start and the all-reduces under way.
  std::vector<bool> ready;
  std::vector<size_t> arrival;
  std::vector<int64_t> waiting;
  size_t next = 0;
  struct Started {
    std::unique_ptr<PendingCollective> pending;
    torch::Tensor flat;
  };
  std::vector<Started> started;
  std::vector<ReducerEvent> events, last_events;

  void make_buckets(const std::vector<size_t>& order, int64_t bucket_bytes);
  void begin_backward();
  void gradient_accumulated(size_t index);
  void start(size_t bucket);
};

namespace {

// Tells the reducer that backward accumulated a parameter's gradient; outlived by nothing it
// needs: a reducer gone leaves its hooks without effect.
class GradientAccumulated final : public torch::autograd::PostAccumulateGradHook {
 public:
  GradientAccumulated(std::weak_ptr<DataParallelReducer::Attached> attached, size_t index)
      : attached_(std::move(attached)), index_(index) {}
  void operator()(const torch::autograd::Variable&) override {
    if (auto attached = attached_.lock()) attached->gradient_accumulated(index_);
  }

 private:
  std::weak_ptr<DataParallelReducer::Attached> attached_;
  size_t index_;
};

int64_t bytes_of(const torch::Tensor& tensor) { return tensor.numel() * static_cast<int64_t>(tensor.element_size()); }

}  // namespace

// Consecutive parameters of `order` in buckets of up to `bucket_bytes`, one dtype and device each.
void DataParallelReducer::Attached::make_buckets(const std::vector<size_t>& order, int64_t bucket_bytes) {
  buckets.clear();
  bucket_of.assign(parameters.size(), 0);
  int64_t bytes = 0;
  for (const size_t i : order) {
    const auto& parameter = parameters[i];
    const auto* first = buckets.empty() ? nullptr : &parameters[buckets.back().front()];
    const bool other_kind =
        first && (first->scalar_type() != parameter.scalar_type() || first->device() != parameter.device());
    if (buckets.empty() || bytes >= bucket_bytes || other_kind) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(i);
    bucket_of[i] = buckets.size() - 1;
    bytes += bytes_of(parameter);
  }
  begin_backward();
}

void DataParallelReducer::Attached::begin_backward() {
  ready.assign(parameters.size(), false);
  arrival.clear();
  waiting.clear();
  for (const auto& bucket : buckets) waiting.push_back(static_cast<int64_t>(bucket.size()));
  next = 0;
  started.clear();
  started.resize(buckets.size());
  events.clear();
}

void DataParallelReducer::Attached::gradient_accumulated(size_t index) {
  std::lock_guard lock(mutex);
  if (!armed) return;  // another update's backward (the VQGAN's generator reaching its discriminator)
  const size_t bucket = bucket_of[index];
  if (ready[index]) {
    if (bucket < next) {
      throw Error("data parallel: parameter " + std::to_string(index) + " accumulated a gradient again after its "
                  "bucket's all-reduce started (one backward reaches it twice); set distributed.overlap: false");
    }
    return;
  }
  ready[index] = true;
  arrival.push_back(index);
  events.push_back({ReducerEvent::gradient_ready, index});
  --waiting[bucket];
  if (!reducer->overlap_) return;
  while (next < buckets.size() && waiting[next] == 0) start(next++);
}

// A gradient this rank lacks enters as zeros.
void DataParallelReducer::Attached::start(size_t bucket) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flat_parts;
  for (const size_t i : buckets[bucket]) {
    auto& parameter = parameters[i];
    if (!parameter.grad().defined()) parameter.mutable_grad() = torch::zeros_like(parameter);
    flat_parts.push_back(parameter.grad().reshape({-1}));
  }
  auto& group = *reducer->group_;
  started[bucket].flat = torch::cat(flat_parts).to(group.device());
  started[bucket].pending = group.start_all_reduce(started[bucket].flat, ReduceOp::average);
  reducer->bytes_reduced_ += bytes_of(started[bucket].flat);
  ++reducer->collectives_;
  events.push_back({ReducerEvent::bucket_started, bucket});
}

DataParallelReducer::DataParallelReducer(std::shared_ptr<ProcessGroup> group, int64_t bucket_bytes, bool overlap)
    : group_(std::move(group)), bucket_bytes_(bucket_bytes), overlap_(overlap) {
  if (!group_) throw Error("data parallel: no process group");
  if (bucket_bytes_ < 1) throw Error("data parallel: buckets of " + std::to_string(bucket_bytes_) + " bytes");
}

DataParallelReducer::~DataParallelReducer() = default;

void DataParallelReducer::before_backward(const std::vector<torch::Tensor>& parameters) {
  for (const auto& attached : attached_) {
    std::lock_guard lock(attached->mutex);
    attached->armed = false;
  }
  if (parameters.empty()) return;
  auto* attached = attached_as(parameters);
  if (!attached) attached = attach(parameters);
  std::lock_guard lock(attached->mutex);
  attached->begin_backward();
  attached->armed = true;
}

DataParallelReducer::Attached* DataParallelReducer::attach(const std::vector<torch::Tensor>& parameters) {
  auto attached = std::make_shared<Attached>();
  attached->reducer = this;
  attached->parameters = parameters;
  const size_t list = attached_.size();
  if (list < restored_orders_.size() && restored_orders_[list].size() == parameters.size()) {
    attached->make_buckets(restored_orders_[list], bucket_bytes_);
    attached->reordered = true;
  } else {
    std::vector<size_t> reverse;
    for (size_t i = parameters.size(); i-- > 0;) reverse.push_back(i);
    attached->make_buckets(reverse, bucket_bytes_);
  }
  for (size_t i = 0; i < parameters.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(parameters[i],
                                                   std::make_unique<GradientAccumulated>(attached, i));
  }
  attached_.push_back(std::move(attached));
  return attached_.back().get();
}

DataParallelReducer::Attached* DataParallelReducer::attached_as(const std::vector<torch::Tensor>& parameters) {
  for (const auto& attached : attached_) {
    if (attached->parameters.size() != parameters.size()) continue;
    bool same = true;
    for (size_t i = 0; same && i < parameters.size(); ++i) same = attached->parameters[i].is_same(parameters[i]);
    if (same) return attached.get();
  }
  return nullptr;
}

void DataParallelReducer::reduce_scaled(const std::vector<torch::Tensor>& parameters) {
  if (auto* attached = attached_as(parameters)) {
    finish(*attached);
  } else {
    reduce_at_once(parameters);
  }
}

// Starts the buckets backward left, waits for all, then leaves undefined the gradients no
// rank had; after the first backward, the buckets follow the order rank 0 saw.
void DataParallelReducer::finish(Attached& attached) {
  torch::NoGradGuard no_grad;
  std::lock_guard lock(attached.mutex);
  auto had = torch::empty({static_cast<int64_t>(attached.parameters.size())}, torch::kFloat32);
  for (size_t i = 0; i < attached.parameters.size(); ++i) {
    had.data_ptr<float>()[i] = attached.parameters[i].grad().defined() ? 1.0f : 0.0f;
  }
  while (attached.next < attached.buckets.size()) attached.start(attached.next++);
  auto any = had.to(group_->device());
  auto any_pending = group_->start_all_reduce(any, ReduceOp::max);
  ++collectives_;
  for (size_t b = 0; b < attached.buckets.size(); ++b) {
    auto& started = attached.started[b];
    started.pending->wait();
    int64_t offset = 0;
    for (const size_t i : attached.buckets[b]) {
      auto gradient = attached.parameters[i].grad();
      gradient.copy_(started.flat.narrow(0, offset, gradient.numel()).view(gradient.sizes()));
      offset += gradient.numel();
    }
  }
  any_pending->wait();
  const auto defined = any.cpu();
  for (size_t i = 0; i < attached.parameters.size(); ++i) {
    if (defined.data_ptr<float>()[i] == 0.0f) attached.parameters[i].mutable_grad() = torch::Tensor();
  }
  attached.armed = false;
  attached.last_events = std::move(attached.events);
  if (!attached.reordered) {
    attached.reordered = true;
    attached.make_buckets(order_of_rank_0(attached.arrival, attached.parameters.size()), bucket_bytes_);
  }
  attached.begin_backward();
}

// `arrival` as rank 0 saw it, the parameters that never came after it (last first), so that
// every rank makes the same buckets.
std::vector<size_t> DataParallelReducer::order_of_rank_0(const std::vector<size_t>& arrival, size_t count) {
  std::vector<int64_t> order(arrival.begin(), arrival.end());
  std::vector<bool> came(count, false);
  for (const size_t i : arrival) came[i] = true;
  for (size_t i = count; i-- > 0;) {
    if (!came[i]) order.push_back(static_cast<int64_t>(i));
  }
  auto shared = group_->rank() == 0 ? torch::tensor(order, torch::kInt64)
                                    : torch::zeros({static_cast<int64_t>(count)}, torch::kInt64);
  shared = shared.to(group_->device());
  group_->all_reduce(shared, ReduceOp::sum);
  ++collectives_;
  shared = shared.cpu();
  return {shared.data_ptr<int64_t>(), shared.data_ptr<int64_t>() + count};
}

void DataParallelReducer::save_state(io::TensorMap& state, const std::string& prefix) {
  for (size_t list = 0; list < attached_.size(); ++list) {
    const auto& attached = *attached_[list];
    if (!attached.reordered) continue;
    std::vector<int64_t> order;
    for (const auto& bucket : attached.buckets) order.insert(order.end(), bucket.begin(), bucket.end());
    state[prefix + "bucket_order." + std::to_string(list)] = torch::tensor(order, torch::kInt64);
  }
}

void DataParallelReducer::load_state(const io::TensorMap& state, const std::string& prefix) {
  restored_orders_.clear();
  for (size_t list = 0;; ++list) {
    const auto found = state.find(prefix + "bucket_order." + std::to_string(list));
    if (found == state.end()) break;
    const auto order = found->second.to(torch::kInt64).contiguous();
    restored_orders_.emplace_back(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel());
  }
}

std::vector<ReducerEvent> DataParallelReducer::last_backward() const {
  return attached_.empty() ? std::vector<ReducerEvent>{} : attached_.front()->last_events;
}

std::vector<std::vector<size_t>> DataParallelReducer::buckets() const {
  return attached_.empty() ? std::vector<std::vector<size_t>>{} : attached_.front()->buckets;
}

// Parameters no update step named: the same buckets, in their order, started at once.
void DataParallelReducer::reduce_at_once(const std::vector<torch::Tensor>& parameters) {
  Attached once;
  once.reducer = this;
  once.parameters = parameters;
  once.reordered = true;
  std::vector<size_t> order(parameters.size());
  std::iota(order.begin(), order.end(), size_t{0});
  once.make_buckets(order, bucket_bytes_);
  finish(once);
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
