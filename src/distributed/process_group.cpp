// The one translation unit that sees c10d's gloo backend and gloo's headers
// (third_party/gloo: the wheel ships gloo's library but not its headers); NCCL's backend is
// made in distributed/nccl_backend.cpp.
#include "dalle/distributed/process_group.h"

#include <gloo/context.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "dalle/error.h"
#include "distributed/nccl_backend.h"

// The headers must describe the gloo compiled into the wheel: inline gloo code reads its
// objects' layout (Debian's libgloo-dev, 2022, has a 72-byte Context).
static_assert(sizeof(gloo::Context) == 64, "third_party/gloo does not match the gloo in the torch wheel");

namespace dalle::distributed {

namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return c10d::ReduceOp::SUM;
    case ReduceOp::average: return c10d::ReduceOp::AVG;
    case ReduceOp::max: return c10d::ReduceOp::MAX;
    case ReduceOp::min: return c10d::ReduceOp::MIN;
  }
  throw Error("unknown reduce op");
}

std::string place(const ProcessGroupOptions& options) {
  return "process group at " + options.address + ":" + std::to_string(options.port) + " (rank " +
         std::to_string(options.rank) + " of " + std::to_string(options.world_size) + "): ";
}

std::string message_of(const std::exception& error) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
  return torch_error ? torch_error->what_without_backtrace() : error.what();
}

constexpr auto kHeartbeat = std::chrono::seconds(1);

// What one rank sends of a collective's whole in a ring: (N-1)/N.
double ring_share(int64_t ranks) { return static_cast<double>(ranks - 1) / static_cast<double>(ranks); }
double bytes_of(const torch::Tensor& tensor) {
  return static_cast<double>(tensor.numel()) * static_cast<double>(tensor.element_size());
}

// gloo's all-gather receives into a flat buffer of its own, then copies it into the output.
// Issued in pieces of at most this much of the output, that buffer is a piece, not the
// whole: above glibc's largest dynamic mmap threshold (32 MiB), so that each piece's buffer is
// mapped and returned when freed, never kept in the heaps of gloo's threads.
constexpr int64_t kGlooPieceBytes = int64_t{64} << 20;

// How many of each rank's values one piece of an all-gather of `input` carries.
int64_t values_per_gloo_piece(const torch::Tensor& input, int64_t ranks) {
  return std::max<int64_t>(1, kGlooPieceBytes / (ranks * static_cast<int64_t>(input.element_size())));
}

// How many pieces an all-gather of `input` is cut into.
int64_t gloo_pieces(const torch::Tensor& input, int64_t ranks) {
  const int64_t piece = values_per_gloo_piece(input, ranks);
  return (input.numel() + piece - 1) / piece;
}

// Piece `index` of `input` of every rank into `gathered` (rank r's at r * input.numel()):
// that part of every rank's place received straight into it.
c10::intrusive_ptr<c10d::Work> gloo_all_gather_piece(c10d::Backend& backend, const torch::Tensor& input,
                                                     const torch::Tensor& gathered, int64_t ranks, int64_t index) {
  const int64_t values = input.numel(), piece = values_per_gloo_piece(input, ranks);
  const int64_t start = index * piece, length = std::min(piece, values - start);
  std::vector<at::Tensor> inputs{input.reshape({-1}).narrow(0, start, length)};
  std::vector<std::vector<at::Tensor>> outputs(1);
  const auto received = gathered.view({-1});
  for (int64_t r = 0; r < ranks; ++r) outputs[0].push_back(received.narrow(0, r * values + start, length));
  return backend.allgather(outputs, inputs);
}

void check_all_gather(const torch::Tensor& tensor, const torch::Tensor& gathered, int64_t ranks) {
  if (gathered.numel() != tensor.numel() * ranks) {
    throw Error("all_gather: " + std::to_string(gathered.numel()) + " elements for " + std::to_string(ranks) +
                " ranks of " + std::to_string(tensor.numel()));
  }
  if (!tensor.is_contiguous() || !gathered.is_contiguous()) {
    throw Error("all_gather: a tensor that is not contiguous");
  }
}

// torch 2.11's flight recorder, one per process, registers each process group on its first
// collective before taking its own lock (pytorch/pytorch#179313): collectives of several
// groups started at once from several threads (ranks as threads, as the tests run them)
// corrupt its map. Gloo's are started one at a time; starting only enqueues, so they still
// run at once. NCCL's first collective may block in communicator set-up and is left alone:
// its ranks are processes.
std::mutex gloo_start_mutex;

std::string heartbeat_key(int64_t rank) { return "heartbeat/" + std::to_string(rank); }

// The group's store: in memory for a group alone, else a TCPStore that rank 0 (or a
// launcher's agent) serves.
c10::intrusive_ptr<c10d::Store> make_store(const ProcessGroupOptions& options) {
  if (options.alone) return c10::make_intrusive<c10d::HashStore>();
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(options.port);
  store_options.isServer = options.serve_store && options.rank == 0;
  store_options.numWorkers = static_cast<std::size_t>(options.world_size);
  store_options.waitWorkers = false;
  store_options.timeout = options.timeout;
  if (options.listen_fd >= 0 && store_options.isServer) store_options.masterListenFd = options.listen_fd;
  return c10::make_intrusive<c10d::TCPStore>(options.address, store_options);
}

}  // namespace

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;  // gloo or NCCL
  bool gloo = false;
  torch::Device device{torch::kCPU};
  int64_t rank = 0, size = 1;
  // Every rank counts up its key in the store each second, so that when a collective fails
  // the others can tell which rank fell silent: gloo says only that a peer went away.
  std::thread heartbeat;
  std::mutex mutex;
  std::condition_variable stopping;
  bool stop = false;
  SimulatedLink link;
  std::mutex link_mutex;
  std::chrono::steady_clock::time_point link_free_at;  // when the simulated link has carried what was queued
  double bytes_sent_so_far = 0;

  void start_heartbeat() {
    heartbeat = std::thread([this] {
      std::unique_lock lock(mutex);
      while (!stopping.wait_for(lock, kHeartbeat, [this] { return stop; })) {
        try {
          store->add(heartbeat_key(rank), 1);
        } catch (const std::exception&) {
          return;  // the store is gone; the next collective says so
        }
      }
    });
  }

  ~Impl() {
    if (!heartbeat.joinable()) return;
    {
      std::lock_guard lock(mutex);
      stop = true;
    }
    stopping.notify_all();
    heartbeat.join();
  }

  std::vector<int64_t> heartbeats() {
    std::vector<int64_t> counts;
    for (int64_t r = 0; r < size; ++r) counts.push_back(store->add(heartbeat_key(r), 0));
    return counts;
  }

  // The ranks whose heartbeat stopped, as "rank 1 stopped answering (its process ended or
  // hangs)"; empty when all still beat.
  std::string silent_ranks() {
    try {
      const auto before = heartbeats();
      std::this_thread::sleep_for(kHeartbeat * 5 / 2);
      const auto after = heartbeats();
      std::string silent;
      for (int64_t r = 0; r < size; ++r) {
        if (r != rank && after[static_cast<size_t>(r)] == before[static_cast<size_t>(r)]) {
          silent += (silent.empty() ? "" : ", ") + std::to_string(r);
        }
      }
      if (silent.empty()) return "";
      return (silent.find(',') == std::string::npos ? "rank " : "ranks ") + silent +
             " stopped answering (ended or hanging)";
    } catch (const std::exception&) {
      return "the rendezvous store is unreachable (the rank serving it, rank 0 unless a launcher's agent does, "
             "has ended)";
    }
  }

  using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;
  // A collective handed to c10d (in one work or several), delayed as `link` would carry
  // `bytes_sent`.
  std::unique_ptr<PendingCollective> pending(Works works, const std::string& what, double bytes_sent);
  std::unique_ptr<PendingCollective> pending(c10::intrusive_ptr<c10d::Work> work, const std::string& what,
                                             double bytes_sent);

  // The collective `call` starts, started as the comment at gloo_start_mutex says.
  template <class Call>
  auto start(Call call) {
    if (device.is_cuda()) return call();
    std::lock_guard lock(gloo_start_mutex);
    return call();
  }

  // Waits for `work`. A lost or late rank becomes an Error naming `what` and the ranks that
  // fell silent.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
    try {
      work->wait();
    } catch (const std::exception& error) {
      const auto silent = silent_ranks();
      throw Error(what + " failed: " + (silent.empty() ? "another rank ended or stopped answering" : silent) +
                  " (" + message_of(error) + ")");
    }
  }
};

ProcessGroup::ProcessGroup(const ProcessGroupOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->rank = options.rank;
  impl_->size = options.world_size;
  impl_->link = options.link;
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    throw Error("process group: rank " + std::to_string(options.rank) + " of a world of " +
                std::to_string(options.world_size));
  }
  if (options.alone && options.world_size != 1) throw Error("process group: a group alone has one rank");
  try {
    impl_->store = c10::make_intrusive<c10d::PrefixStore>(options.prefix, make_store(options));
    const int rank = static_cast<int>(options.rank), size = static_cast<int>(options.world_size);
    if (options.backend == Backend::nccl) {
      impl_->backend = detail::make_nccl_backend(impl_->store, rank, size, options.timeout, options.cuda_device);
      impl_->device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(options.cuda_device));
    } else {
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
      gloo_options->devices = {c10d::ProcessGroupGloo::createDeviceForHostname(options.address)};
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, rank, size, gloo_options);
      impl_->gloo = true;
    }
    impl_->start_heartbeat();
  } catch (const std::exception& error) {
    throw Error(place(options) + message_of(error));
  }
}

ProcessGroup::~ProcessGroup() = default;

int64_t ProcessGroup::rank() const { return impl_->backend->getRank(); }
int64_t ProcessGroup::size() const { return impl_->backend->getSize(); }
torch::Device ProcessGroup::device() const { return impl_->device; }

namespace {

class PendingWork final : public PendingCollective {
 public:
  PendingWork(ProcessGroup::Impl& group, ProcessGroup::Impl::Works works, std::string what,
              std::optional<std::chrono::steady_clock::time_point> not_before)
      : group_(group), works_(std::move(works)), what_(std::move(what)), not_before_(not_before) {}
  void wait() override {
    for (const auto& work : works_) group_.wait(work, what_);
    if (not_before_) std::this_thread::sleep_until(*not_before_);
  }

 private:
  ProcessGroup::Impl& group_;
  ProcessGroup::Impl::Works works_;
  std::string what_;
  std::optional<std::chrono::steady_clock::time_point> not_before_;
};

// A collective whose result `then` completes once it is done.
class PendingThen final : public PendingCollective {
 public:
  PendingThen(std::unique_ptr<PendingCollective> collective, std::function<void()> then)
      : collective_(std::move(collective)), then_(std::move(then)) {}
  void wait() override {
    collective_->wait();
    if (then_) std::exchange(then_, nullptr)();
  }

 private:
  std::unique_ptr<PendingCollective> collective_;
  std::function<void()> then_;
};

}  // namespace

std::unique_ptr<PendingCollective> ProcessGroup::Impl::pending(c10::intrusive_ptr<c10d::Work> work,
                                                               const std::string& what, double bytes_sent) {
  return pending(Works{std::move(work)}, what, bytes_sent);
}

std::unique_ptr<PendingCollective> ProcessGroup::Impl::pending(Works works, const std::string& what,
                                                               double bytes_sent) {
  std::optional<std::chrono::steady_clock::time_point> not_before;
  std::lock_guard lock(link_mutex);
  bytes_sent_so_far += bytes_sent;
  if (link.enabled()) {
    const double seconds = link.latency_ms / 1e3 + bytes_sent * 8 / (link.gigabits_per_second * 1e9);
    using Duration = std::chrono::steady_clock::duration;
    link_free_at = std::max(link_free_at, std::chrono::steady_clock::now()) +
                   std::chrono::duration_cast<Duration>(std::chrono::duration<double>(seconds));
    not_before = link_free_at;
  }
  return std::make_unique<PendingWork>(*this, std::move(works), what, not_before);
}

void ProcessGroup::all_reduce(torch::Tensor& tensor, ReduceOp op) { start_all_reduce(tensor, op)->wait(); }

std::unique_ptr<PendingCollective> ProcessGroup::start_all_reduce(torch::Tensor& tensor, ReduceOp op) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  auto work = impl_->start([&] { return impl_->backend->allreduce(tensors, options); });
  return impl_->pending(std::move(work), "all_reduce", 2.0 * ring_share(size()) * bytes_of(tensor));
}

void ProcessGroup::all_gather(const torch::Tensor& tensor, torch::Tensor& gathered) {
  if (!impl_->gloo) return start_all_gather(tensor.contiguous(), gathered)->wait();
  // Waited for piece by piece, gloo's buffer is one piece at a time.
  const auto input = tensor.contiguous();
  check_all_gather(input, gathered, size());
  for (int64_t index = 0; index < gloo_pieces(input, size()); ++index) {
    impl_->wait(impl_->start([&] { return gloo_all_gather_piece(*impl_->backend, input, gathered, size(), index); }),
                "all_gather");
  }
  impl_->pending(Impl::Works{}, "all_gather", ring_share(size()) * bytes_of(gathered))->wait();
}

std::unique_ptr<PendingCollective> ProcessGroup::start_all_gather(const torch::Tensor& tensor,
                                                                  torch::Tensor& gathered) {
  check_all_gather(tensor, gathered, size());
  const double bytes_sent = ring_share(size()) * bytes_of(gathered);
  if (impl_->gloo) {
    auto works = impl_->start([&] {
      Impl::Works started;
      for (int64_t index = 0; index < gloo_pieces(tensor, size()); ++index) {
        started.push_back(gloo_all_gather_piece(*impl_->backend, tensor, gathered, size(), index));
      }
      return started;
    });
    return impl_->pending(std::move(works), "all_gather", bytes_sent);
  }
  auto input = tensor;
  auto work = impl_->start([&] { return impl_->backend->_allgather_base(gathered, input); });
  return impl_->pending(std::move(work), "all_gather", bytes_sent);
}

void ProcessGroup::reduce_scatter(torch::Tensor& input, torch::Tensor& output, ReduceOp op) {
  start_reduce_scatter(input, output, op)->wait();
}

std::unique_ptr<PendingCollective> ProcessGroup::start_reduce_scatter(torch::Tensor& input, torch::Tensor& output,
                                                                      ReduceOp op) {
  if (input.numel() != output.numel() * size()) {
    throw Error("reduce_scatter: " + std::to_string(input.numel()) + " elements for " + std::to_string(size()) +
                " ranks of " + std::to_string(output.numel()));
  }
  if (!input.is_contiguous()) throw Error("reduce_scatter: an input that is not contiguous");
  const double bytes_sent = ring_share(size()) * bytes_of(input);
  if (impl_->gloo) {
    // gloo's reduce-scatter all-reduces a copy of its input and copies this rank's part out:
    // the input itself is all-reduced (the same sums, without a second input-sized buffer).
    std::vector<at::Tensor> tensors{input};
    c10d::AllreduceOptions options;
    options.reduceOp = to_c10d(op);
    auto work = impl_->start([&] { return impl_->backend->allreduce(tensors, options); });
    const auto mine = input.narrow(0, rank() * output.numel(), output.numel());
    return std::make_unique<PendingThen>(impl_->pending(std::move(work), "reduce_scatter", bytes_sent),
                                         [mine, output]() mutable { output.copy_(mine); });
  }
  c10d::ReduceScatterOptions options;
  options.reduceOp = to_c10d(op);
  auto work = impl_->start([&] { return impl_->backend->_reduce_scatter_base(output, input, options); });
  return impl_->pending(std::move(work), "reduce_scatter", bytes_sent);
}

void ProcessGroup::barrier() {
  impl_->pending(impl_->start([&] { return impl_->backend->barrier(); }), "barrier", 0)->wait();
}

double ProcessGroup::bytes_sent() const {
  std::lock_guard lock(impl_->link_mutex);
  return impl_->bytes_sent_so_far;
}

void ProcessGroup::set_simulated_link(const SimulatedLink& link) {
  std::lock_guard lock(impl_->link_mutex);
  impl_->link = link;
}

SimulatedLink parse_simulated_link(const std::string& text) {
  const auto refuse = [&text](const std::string& why) {
    return Error("a simulated link is 'gbps,latency_ms' (for instance '10,0.5')" + why + ", not '" + text + "'");
  };
  const auto number = [&](const std::string& part) {
    size_t used = 0;
    double value = 0;
    try {
      value = std::stod(part, &used);
    } catch (const std::exception&) {
      throw refuse("");
    }
    if (used != part.size()) throw refuse("");
    return value;
  };
  const auto comma = text.find(',');
  SimulatedLink link{.gigabits_per_second = number(text.substr(0, comma)),
                     .latency_ms = comma == std::string::npos ? 0.0 : number(text.substr(comma + 1))};
  if (!(link.gigabits_per_second > 0) || !(link.latency_ms >= 0)) {
    throw refuse(" with a bandwidth above 0 and a latency of 0 or more");
  }
  return link;
}

}  // namespace dalle::distributed
