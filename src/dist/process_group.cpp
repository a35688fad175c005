// The one translation unit that sees c10d's gloo backend and gloo's headers
// (third_party/gloo: the wheel ships gloo's library but not its headers).
#include "dalle/dist/process_group.h"

#include <gloo/context.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dalle/error.h"

// The headers must describe the gloo compiled into the wheel: inline gloo code reads its
// objects' layout (Debian's libgloo-dev, 2022, has a 72-byte Context).
static_assert(sizeof(gloo::Context) == 64, "third_party/gloo does not match the gloo in the torch wheel");

namespace dalle::dist {

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

// Waits for `work`, turning c10d's errors (a lost or late rank) into Error with `what`.
void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  try {
    work->wait();
  } catch (const c10::Error& error) {
    throw Error(what + " failed, another rank ended or stopped answering: " + error.what_without_backtrace());
  } catch (const std::exception& error) {
    throw Error(what + " failed, another rank ended or stopped answering: " + error.what());
  }
}

std::string place(const ProcessGroupOptions& options) {
  return "process group at " + options.address + ":" + std::to_string(options.port) + " (rank " +
         std::to_string(options.rank) + " of " + std::to_string(options.world_size) + "): ";
}

}  // namespace

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
};

ProcessGroup::ProcessGroup(const ProcessGroupOptions& options) : impl_(std::make_unique<Impl>()) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    throw Error("process group: rank " + std::to_string(options.rank) + " of a world of " +
                std::to_string(options.world_size));
  }
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(options.port);
  store_options.isServer = options.serve_store && options.rank == 0;
  store_options.numWorkers = static_cast<std::size_t>(options.world_size);
  store_options.waitWorkers = false;
  store_options.timeout = options.timeout;
  if (options.listen_fd >= 0 && store_options.isServer) store_options.masterListenFd = options.listen_fd;
  try {
    auto tcp = c10::make_intrusive<c10d::TCPStore>(options.address, store_options);
    impl_->store = c10::make_intrusive<c10d::PrefixStore>(options.prefix, tcp);
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    gloo_options->devices = {c10d::ProcessGroupGloo::createDeviceForHostname(options.address)};
    impl_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, static_cast<int>(options.rank),
                                                             static_cast<int>(options.world_size), gloo_options);
  } catch (const c10::Error& error) {
    throw Error(place(options) + error.what_without_backtrace());
  } catch (const std::exception& error) {
    throw Error(place(options) + error.what());
  }
}

ProcessGroup::~ProcessGroup() = default;

int64_t ProcessGroup::rank() const { return impl_->gloo->getRank(); }
int64_t ProcessGroup::size() const { return impl_->gloo->getSize(); }

void ProcessGroup::all_reduce(torch::Tensor& tensor, ReduceOp op) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  wait(impl_->gloo->allreduce(tensors, options), "all_reduce");
}

void ProcessGroup::all_gather(const torch::Tensor& tensor, torch::Tensor& gathered) {
  if (gathered.numel() != tensor.numel() * size()) {
    throw Error("all_gather: " + std::to_string(gathered.numel()) + " elements for " + std::to_string(size()) +
                " ranks of " + std::to_string(tensor.numel()));
  }
  auto input = tensor.contiguous();
  wait(impl_->gloo->_allgather_base(gathered, input), "all_gather");
}

void ProcessGroup::barrier() { wait(impl_->gloo->barrier(), "barrier"); }

}  // namespace dalle::dist
