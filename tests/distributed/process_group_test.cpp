#include "dalle/distributed/process_group.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include "distributed/on_ranks.h"
#include "test_support.h"

namespace dalle::distributed {
namespace {

// Runs `body(group)` on `world` ranks, one thread each.
template <class Body>
void on_ranks(int64_t world, Body body) {
  testing::on_ranks(world, [&body](const LaunchEnvironment& place) { body(*testing::group_at(place)); });
}

class ProcessGroupAtWorldSize : public ::testing::TestWithParam<int64_t> {};

TEST_P(ProcessGroupAtWorldSize, AllReduceAndAllGatherOverGlooOnLoopback) {
  const int64_t world = GetParam();
  on_ranks(world, [world](ProcessGroup& group) {
    EXPECT_EQ(group.size(), world);
    const double sum = static_cast<double>(world * (world + 1) / 2);  // ranks contribute 1 .. world
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
      auto tensor = torch::full({3}, static_cast<double>(group.rank() + 1), torch::TensorOptions().dtype(dtype));
      group.all_reduce(tensor);
      EXPECT_TRUE(torch::equal(tensor, torch::full({3}, sum, tensor.options()))) << dtype;
      auto mean = torch::full({2}, static_cast<double>(2 * group.rank()), tensor.options());
      group.all_reduce(mean, ReduceOp::average);
      EXPECT_EQ(mean[0].item<double>(), static_cast<double>(world - 1)) << dtype;
      auto largest = torch::full({1}, static_cast<double>(group.rank()), tensor.options());
      group.all_reduce(largest, ReduceOp::max);
      EXPECT_EQ(largest.item<double>(), static_cast<double>(world - 1));
    }
    auto gathered = torch::empty({2 * world});
    group.all_gather(torch::full({2}, static_cast<double>(group.rank())), gathered);
    EXPECT_TRUE(torch::equal(gathered, torch::arange(world).to(torch::kFloat32).repeat_interleave(2)));
    EXPECT_THROW_WITH(group.all_gather(torch::ones({3}), gathered), Error, "all_gather:");
    // An output of more than one of gloo's pieces (64 MiB), the last piece short, started or
    // waited for piece by piece.
    const int64_t values = (int64_t{17} << 20) / world + 3;
    const auto own = torch::arange(values * group.rank(), values * (group.rank() + 1)).to(torch::kFloat32);
    auto whole = torch::empty({values * world});
    group.start_all_gather(own, whole)->wait();
    EXPECT_TRUE(torch::equal(whole, torch::arange(values * world).to(torch::kFloat32)));
    whole.zero_();
    group.all_gather(own, whole);
    EXPECT_TRUE(torch::equal(whole, torch::arange(values * world).to(torch::kFloat32)));
    // Rank r sends r + i at place i; each receives its two places summed, or averaged.
    const auto places = torch::arange(2 * world).to(torch::kFloat32);
    const auto mine = places.slice(0, 2 * group.rank(), 2 * group.rank() + 2);
    auto input = places + static_cast<double>(group.rank()), part = torch::empty({2});
    group.reduce_scatter(input, part);
    EXPECT_TRUE(torch::equal(part, world * mine + sum - world));
    input = places + static_cast<double>(group.rank());
    group.start_reduce_scatter(input, part, ReduceOp::average)->wait();
    EXPECT_TRUE(torch::equal(part, mine + (sum - world) / world));
    auto odd = torch::ones({2 * world + 1});
    EXPECT_THROW_WITH(group.reduce_scatter(odd, part), Error, "reduce_scatter:");
    group.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ProcessGroupAtWorldSize, ::testing::Values(2, 4));

double thread_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

// 0.1 Gbit/s and 40 ms: an all-reduce of 250,000 floats between 2 ranks sends 1 MB a rank
// (2 (N-1)/N of the payload), 80 ms on the wire; two queue on the link one after the other.
TEST(SimulatedLink, ACollectiveCompletesAfterLatencyPlusBytesOverBandwidthSpendingNoCpu) {
  const SimulatedLink link{.gigabits_per_second = 0.1, .latency_ms = 40};
  testing::on_ranks(2, [&](const LaunchEnvironment& place) {
    auto group = testing::group_at(place, link);
    auto tensor = torch::full({250000}, static_cast<double>(place.rank));
    group->barrier();
    const auto start = std::chrono::steady_clock::now();
    const double cpu_before = thread_cpu_seconds();
    group->all_reduce(tensor, ReduceOp::average);
    const auto one = std::chrono::steady_clock::now() - start;
    EXPECT_GE(one, std::chrono::milliseconds(120));
    EXPECT_LT(one, std::chrono::seconds(5));
    EXPECT_LT(thread_cpu_seconds() - cpu_before, 0.05) << "the wait sleeps";
    EXPECT_EQ(tensor[0].item<float>(), 0.5f);
    auto second = torch::ones({250000});
    const auto queued = std::chrono::steady_clock::now();
    auto first = group->start_all_reduce(tensor);
    auto then = group->start_all_reduce(second);
    then->wait();
    first->wait();
    EXPECT_GE(std::chrono::steady_clock::now() - queued, std::chrono::milliseconds(240)) << "one link, one at a time";
  });
}

TEST(SimulatedLink, IsReadFromGbpsAndLatencyAndRefusesAnythingElse) {
  const auto link = parse_simulated_link("10,0.5");
  EXPECT_EQ(link.gigabits_per_second, 10);
  EXPECT_EQ(link.latency_ms, 0.5);
  EXPECT_EQ(parse_simulated_link("2.5").latency_ms, 0);
  for (const char* bad : {"", "fast", "10,", "10;1", "0,1", "10,-1", "10,1,2", "10x,1"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW_WITH(parse_simulated_link(bad), Error, "gbps,latency_ms");
  }
}

TEST(ProcessGroup, ARankThatNeverJoinsEndsTheOthersWithinTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW_WITH(ProcessGroup({.port = 0, .rank = 0, .world_size = 2, .timeout = std::chrono::seconds(2)}),
                    Error, "process group at 127.0.0.1:", "rank 0 of 2");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

// The NCCL backend in a job of one GPU (NCCL refuses two ranks on one device, and a lent
// machine has one): every collective the reducers use runs on CUDA tensors and gives what
// gloo gives. Skipped where torch sees no CUDA device.
TEST(ProcessGroup, NcclCarriesEveryCollectiveOnAGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "torch sees no CUDA device";
  ProcessGroup group({.port = 0, .timeout = std::chrono::seconds(60), .backend = Backend::nccl});
  const auto on_gpu = torch::TensorOptions().device(torch::kCUDA);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    auto tensor = torch::arange(6, on_gpu.dtype(dtype));
    const auto before = tensor.clone();
    group.all_reduce(tensor);
    group.all_reduce(tensor, ReduceOp::average);
    group.all_reduce(tensor, ReduceOp::max);
    EXPECT_TRUE(torch::equal(tensor, before)) << dtype;
  }
  auto gathered = torch::empty({4}, on_gpu);
  group.all_gather(torch::full({4}, 3.0, on_gpu), gathered);
  EXPECT_TRUE(torch::equal(gathered.cpu(), torch::full({4}, 3.0)));
  auto prefetched = torch::empty({4}, on_gpu);
  group.start_all_gather(torch::full({4}, 5.0, on_gpu), prefetched)->wait();
  EXPECT_TRUE(torch::equal(prefetched.cpu(), torch::full({4}, 5.0)));
  auto scattered = torch::empty({4}, on_gpu);
  auto reduced = torch::arange(4, on_gpu.dtype(torch::kFloat32));
  group.reduce_scatter(reduced, scattered);
  EXPECT_TRUE(torch::equal(scattered.cpu(), torch::arange(4).to(torch::kFloat32)));
  group.barrier();
}

}  // namespace
}  // namespace dalle::distributed
