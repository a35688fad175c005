// Training jobs of several processes on 127.0.0.1, run as a user runs them: the tools under
// dalle's own --nproc-per-node launcher, against one process, with ranks killed, stopped and
// started wrongly. Small models, and a timeout on every wait.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/cuda.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "dalle/io/checkpoint.h"
#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/trained.h"
#include "test_support.h"
#include "tool_runner.h"

namespace dalle {
namespace {

using testing::run;
using testing::run_command;
using testing::ScratchDir;

// Token datasets for a tiny prior, and the images they came from, made once for the suite.
class TrainingJob : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    data_ = new ScratchDir;
    const auto& d = *data_;
    const auto check = [](const testing::Result& result) { ASSERT_EQ(result.status, 0) << result.output; };
    check(run("dalle-data", "compose --out " + (d / "fc") +
                                " --set train_images=32 --set test_images=8 --set heldout_images=0"));
    check(run("dalle-tokenizer", "train --captions " + (d / "fc/train") + " --out " + (d / "tok.model") +
                                     " --set vocab_size=60 --set text_length=12"));
    check(run("dalle-train-vae", "--out " + (d / "dvae") + " --set data.train=" + (d / "fc/train") +
                                     " --set data.validation=" + (d / "fc/test") +
                                     " --set data.image_size=16 --set data.batch_size=8 --set model.hidden=8"
                                     " --set model.decoder_init=8 --set model.groups=2 --set model.downsamplings=1"
                                     " --set model.blocks_per_group=1 --set model.vocab_size=32 --set run.steps=1"));
    for (const char* split : {"train", "test"}) {
      check(run("dalle-encode-images", "--dataset " + (d / "fc/" + split) + " --dvae " + (d / "dvae") +
                                           " --tokenizer " + (d / "tok.model") + " --out " + (d / "tokens-" + split)));
    }
    testing::write_text(d / "prior.yaml",
                        "model: {text_length: 12, text_vocab_size: 60, grid_size: 8, image_vocab_size: 32,\n"
                        "        layers: 2, width: 32, heads: 2, conv_kernel: 3}\n"
                        "data: {train: " + (d / "tokens-train") + ", validation: " + (d / "tokens-test") +
                        ", batch_size: 8, caption_dropout: 0.2}\n"
                        "learning_rate: {peak: 1.0e-3, warmup_steps: 2, decay: cosine}\n"
                        "run: {steps: 10, log_every: 1, validate_every: 1000000, checkpoint_every: 5, threads: 1}\n"
                        "distributed: {timeout_seconds: 20}\n");
  }
  static void TearDownTestSuite() {
    delete data_;
    data_ = nullptr;
  }

  // dalle-train on the suite's prior recipe into `run`, with `arguments` added.
  static std::string train_prior(const std::string& run, const std::string& arguments = "") {
    return testing::tool_path("dalle-train") + " --config " + (*data_ / "prior.yaml") + " --out " + run + " " +
           arguments;
  }

  // The suite's prior trained 5 updates into `run`: the base the fine-tuning tests start from.
  static void train_base(const std::string& run) {
    auto base = run_command(train_prior(run, "--set run.steps=5"));
    ASSERT_EQ(base.status, 0) << base.output;
  }

  static ScratchDir* data_;
};

ScratchDir* TrainingJob::data_ = nullptr;

io::TensorMap weights_at(const std::string& run, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%09lld", static_cast<long long>(step));
  return io::load_checkpoint(run + "/checkpoints/" + name).weights;  // sharded ones joined
}

double largest_difference(const io::TensorMap& a, const io::TensorMap& b) {
  double largest = 0;
  EXPECT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : a) {
    largest = std::max(largest, (tensor - b.at(name)).abs().max().item<double>());
  }
  return largest;
}

// The metrics line of update `step` that has a "loss".
nlohmann::json metrics_at(const std::string& run, int64_t step) {
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto entry = nlohmann::json::parse(line);
    if (entry["step"] == step && entry.contains("loss")) return entry;
  }
  ADD_FAILURE() << "no metrics line with a loss for update " << step << " in " << run;
  return {};
}

// The validation loss the run logged at update `step`.
double validation_at(const std::string& run, int64_t step) {
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto entry = nlohmann::json::parse(line);
    if (entry["step"] == step && entry.contains("validation_loss")) return entry["validation_loss"].get<double>();
  }
  ADD_FAILURE() << "no validation loss for update " << step << " in " << run;
  return std::nan("");
}

// A shell snippet that waits (at most 60 s) for `path`, then sets $rank to the pid of the
// launcher $pid's child whose RANK is `rank`.
std::string find_rank_when(const std::string& path, int64_t rank) {
  return "for i in $(seq 3000); do [ -e " + path + " ] && break; sleep 0.02; done; rank=; "
         "for p in $(pgrep -P $pid); do tr '\\0' '\\n' < /proc/$p/environ | grep -qx RANK=" +
         std::to_string(rank) + " && rank=$p; done; ";
}

// Ends the launcher $pid if it outlives 60 s, then waits for it.
const char* const kWatchdog =
    "(for i in $(seq 600); do kill -0 $pid || exit; sleep 0.1; done; kill -KILL $pid) >/dev/null 2>&1 & wait $pid";

// `train` + a run folder trains 10 updates, checkpointing the last: in one process and on
// two ranks, to the same weights.
void expect_two_ranks_train_as_one_process(const std::string& train, const ScratchDir& dir) {
  auto one = run_command(train + (dir / "one"));
  ASSERT_EQ(one.status, 0) << one.output;
  auto job = run_command(train + (dir / "job") + " --nproc-per-node 2");
  ASSERT_EQ(job.status, 0) << job.output;
  EXPECT_LT(largest_difference(weights_at(dir / "one", 10), weights_at(dir / "job", 10)), 1e-5);
}

class TrainingJobAtWorldSize : public TrainingJob, public ::testing::WithParamInterface<int64_t> {};

// Each rank takes every ranks-th example of the global batch and their gradients are
// averaged: the same updates as one process, but for the order of the sums.
TEST_P(TrainingJobAtWorldSize, TheRanksTrainThePriorAsOneProcessDoes) {
  const int64_t ranks = GetParam();
  ScratchDir dir;
  auto one = run_command(train_prior(dir / "one"));
  ASSERT_EQ(one.status, 0) << one.output;
  const std::string validated = " --set run.validate_every=5";
  auto job = run_command(train_prior(dir / "job", "--nproc-per-node " + std::to_string(ranks) + validated));
  ASSERT_EQ(job.status, 0) << job.output;
  EXPECT_THAT(job.output, ::testing::HasSubstr("joined a job of " + std::to_string(ranks) + " ranks"));
  EXPECT_LT(largest_difference(weights_at(dir / "one", 10), weights_at(dir / "job", 10)), 1e-5);
  // The logged loss is the mean of the ranks' losses, which is the global batch's.
  EXPECT_NEAR(metrics_at(dir / "job", 10)["loss"].get<double>(), metrics_at(dir / "one", 10)["loss"].get<double>(),
              1e-5);
  // Rank 0 alone writes the run; every other rank writes its own log.
  EXPECT_TRUE(std::filesystem::exists(dir / ("job.rank" + std::to_string(ranks - 1) + ".log")));
  EXPECT_THAT(testing::read_text(dir / "job.rank1.log"), ::testing::HasSubstr("[rank 1] prior: training from"));

  // ZeRO-3: each rank holds 1/N of every resblock, cut as each is drawn (the prior is built
  // one block at a time, with the whole build's weights), and trains as data parallelism does. It
  // validates and draws its sample grids on the sharded model, the average gathered block by
  // block (no rank holds a whole copy): the validation copy's losses.
  const std::string samples = " --set tokenizer=" + (*data_ / "tok.model") + " --set image_tokenizer=" +
                              (*data_ / "dvae") + " --set 'sample_captions=[a red bag]' --set samples_per_caption=2";
  auto sharded = run_command(train_prior(dir / "sharded", "--nproc-per-node " + std::to_string(ranks) +
                                                              " --set distributed.sharding=within_node" + validated +
                                                              samples));
  ASSERT_EQ(sharded.status, 0) << sharded.output;
  EXPECT_THAT(sharded.output, ::testing::HasSubstr("each holds 1/" + std::to_string(ranks)));
  EXPECT_THAT(sharded.output, ::testing::HasSubstr("built one resblock at a time, each drawn and cut into " +
                                                   std::to_string(ranks) + " shards"));
  EXPECT_LT(largest_difference(weights_at(dir / "job", 10), weights_at(dir / "sharded", 10)), 1e-5);
  for (const int64_t step : {5, 10}) {
    EXPECT_NEAR(validation_at(dir / "sharded", step), validation_at(dir / "job", step), 1e-5) << step;
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "sharded/samples/step-000000010.png"));
  // Every rank wrote its shard of the resblocks; dalle-export reads them one resblock at a time
  // and writes what load_checkpoint joins, bit for bit.
  EXPECT_TRUE(std::filesystem::exists(dir / "sharded/checkpoints/step-000000010/shard-00000-of-0000" +
                                      std::to_string(ranks) + ".safetensors"));
  auto exported = run("dalle-export", (dir / "sharded") + " --out " + (dir / "exported"));
  ASSERT_EQ(exported.status, 0) << exported.output;
  EXPECT_THAT(exported.output, ::testing::HasSubstr("read and written one resblock at a time"));
  const auto model = io::read_safetensors(dir / "exported/model.safetensors").tensors;
  const auto joined =
      io::inference_weights(io::load_inference_checkpoint(dir / "sharded/checkpoints/step-000000010"));
  ASSERT_EQ(model.size(), joined.size());
  for (const auto& [name, tensor] : joined) EXPECT_TRUE(torch::equal(model.at(name), tensor)) << name;
  const auto average = io::with_prefix_removed(
      io::read_safetensors(dir / "job/checkpoints/step-000000010/state.safetensors").tensors, "ema.");
  EXPECT_LT(largest_difference(average, model), 1e-5) << "the moving average of data parallelism's run";
}

// Overlap changes when the bytes move, never which are summed: data parallelism, sharding
// (with one bucket, and with many; prefetching each block's gather before its gradients and
// after them) and PowerSGD (whole, then compressed), in fp16 with per-resblock scales, end on
// the same bits with their buckets and reduce-scatters started during backward and after it.
TEST_P(TrainingJobAtWorldSize, OverlappedAndAfterBackwardReductionsGiveIdenticalWeights) {
  const int64_t ranks = GetParam();
  ScratchDir dir;
  const std::string job = " --nproc-per-node " + std::to_string(ranks) +
                          " --set precision.mode=float16 --set run.steps=4 --set run.checkpoint_every=4";
  const std::vector<std::pair<std::string, std::string>> kinds{
      {"data-parallel", ""},
      {"sharded", " --set distributed.sharding=within_node"},
      // Buckets of 4 kB: the replicated gradients' many all-reduces interleave with the blocks'
      // reduce-scatters (on a group of their own) during backward.
      {"sharded-buckets", " --set distributed.sharding=within_node --set distributed.bucket_megabytes=0.004"},
      {"sharded-after-gradients", " --set distributed.sharding=within_node"
                                  " --set distributed.backward_prefetch=after_gradients"},
      {"powersgd", " --set distributed.gradient_reduction=powersgd --set distributed.powersgd.start_update=3"
                   " --set distributed.powersgd.rank=2 --set distributed.powersgd.min_compression_rate=0"}};
  for (const auto& [name, setting] : kinds) {
    auto overlapped = run_command(train_prior(dir / name, job + setting));
    ASSERT_EQ(overlapped.status, 0) << overlapped.output;
    auto after = run_command(train_prior(dir / (name + "-after"), job + setting + " --set distributed.overlap=false"));
    ASSERT_EQ(after.status, 0) << after.output;
    const auto a = weights_at(dir / name, 4), b = weights_at(dir / (name + "-after"), 4);
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [key, tensor] : a) EXPECT_TRUE(torch::equal(tensor, b.at(key))) << name << ": " << key;
  }
  const auto before = weights_at(dir / "sharded", 4), after = weights_at(dir / "sharded-after-gradients", 4);
  ASSERT_EQ(before.size(), after.size());
  for (const auto& [key, tensor] : before) EXPECT_TRUE(torch::equal(tensor, after.at(key))) << "prefetch: " << key;
}

// PowerSGD at a rank that spans every matrix averages as data parallelism does, to the
// rounding of the orthogonalization (which AdamW magnifies on the rows no batch reaches, so
// the losses are compared, not the weights); at rank 2 it trains on.
TEST_F(TrainingJob, PowerSgdAtFullRankTrainsAsDataParallelAndAtLowRankTrainsOn) {
  ScratchDir dir;
  auto data_parallel = run_command(train_prior(dir / "job", "--nproc-per-node 2"));
  ASSERT_EQ(data_parallel.status, 0) << data_parallel.output;
  const std::string powersgd = " --nproc-per-node 2 --set distributed.gradient_reduction=powersgd"
                               " --set distributed.powersgd.start_update=1 --set distributed.powersgd.min_compression_rate=0";
  auto full = run_command(train_prior(dir / "full", powersgd + " --set distributed.powersgd.rank=128"));
  ASSERT_EQ(full.status, 0) << full.output;
  for (int64_t step : {1, 2, 5, 10}) {
    EXPECT_NEAR(metrics_at(dir / "full", step)["loss"].get<double>(), metrics_at(dir / "job", step)["loss"].get<double>(),
                1e-4)
        << "update " << step;
  }
  auto low = run_command(train_prior(dir / "low", powersgd + " --set distributed.powersgd.rank=2"));
  ASSERT_EQ(low.status, 0) << low.output;
  const double low_loss = metrics_at(dir / "low", 10)["loss"].get<double>();
  EXPECT_TRUE(std::isfinite(low_loss));
  EXPECT_LT(low_loss, metrics_at(dir / "low", 1)["loss"].get<double>()) << "it learns";
  EXPECT_GT(std::abs(low_loss - metrics_at(dir / "job", 10)["loss"].get<double>()), 1e-5) << "compressed";
}

// The error feedback comes back with a resume (as its mean over the ranks, which is what
// the next averages see): stopped at update 5 and resumed, a rank-2 run takes the updates
// of an uninterrupted one. Plateau decay: the learning rate does not depend on run.steps.
TEST_F(TrainingJob, PowerSgdResumesAsIfUninterrupted) {
  ScratchDir dir;
  const std::string powersgd = " --nproc-per-node 2 --set distributed.gradient_reduction=powersgd"
                               " --set distributed.powersgd.start_update=1 --set distributed.powersgd.rank=2"
                               " --set learning_rate.decay=plateau";
  auto uninterrupted = run_command(train_prior(dir / "whole", powersgd));
  ASSERT_EQ(uninterrupted.status, 0) << uninterrupted.output;
  for (const char* steps : {"5", "10"}) {
    auto leg = run_command(train_prior(dir / "resumed", powersgd + " --set run.steps=" + steps));
    ASSERT_EQ(leg.status, 0) << leg.output;
  }
  EXPECT_LT(largest_difference(weights_at(dir / "whole", 10), weights_at(dir / "resumed", 10)), 1e-5);
  EXPECT_TRUE(io::load_checkpoint(dir / "resumed/checkpoints/step-000000005").state.count("reducer.error.0"));
}

// fp16 with per-resblock scales under sharding: the scales (M x 2^13 at the start), the
// skipped updates and the losses follow data parallelism's. The weights agree less closely
// than in fp32: data parallelism unscales each rank's gradients before averaging them,
// sharding after its reduce-scatter, and the scales are not powers of two; AdamW turns the
// last-bit differences of near-zero gradients into differences of up to a step.
TEST_F(TrainingJob, ShardedFp16ScalesAndSkipsAsDataParallelDoes) {
  ScratchDir dir;
  const std::string fp16 = " --nproc-per-node 2 --set precision.mode=float16";
  auto data_parallel = run_command(train_prior(dir / "job", fp16));
  ASSERT_EQ(data_parallel.status, 0) << data_parallel.output;
  auto sharded = run_command(train_prior(dir / "sharded", fp16 + " --set distributed.sharding=within_node"));
  ASSERT_EQ(sharded.status, 0) << sharded.output;
  for (int64_t step = 1; step <= 10; ++step) {
    EXPECT_NEAR(metrics_at(dir / "job", step)["loss"].get<double>(), metrics_at(dir / "sharded", step)["loss"].get<double>(),
                1e-5)
        << "update " << step;
  }
  EXPECT_LT(largest_difference(weights_at(dir / "job", 10), weights_at(dir / "sharded", 10)), 1e-3);
  for (const char* key : {"grad_scale_min", "grad_scale_max", "skipped_updates"}) {
    EXPECT_EQ(metrics_at(dir / "job", 10)[key], metrics_at(dir / "sharded", 10)[key]) << key;
  }
  EXPECT_GE(metrics_at(dir / "sharded", 1)["grad_scale_min"].get<double>(), 2 * 8192.0);
}

// Every multi-GPU code path short of NCCL itself: two ranks share the one GPU over gloo, which
// carries CUDA tensors through the host, plain, sharded and with PowerSGD at full rank, and
// train as one process on the GPU does (only where torch sees a CUDA device). The GPU's
// kernels sum in their own orders, so losses are held to 1e-4 and the weights to 1e-3.
TEST_F(TrainingJob, TwoRanksSharingOneGpuOverGlooTrainAsOneProcessOnAGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "torch sees no CUDA device";
  ScratchDir dir;
  auto one = run_command(train_prior(dir / "one", "--set run.device=cuda"));
  ASSERT_EQ(one.status, 0) << one.output;
  const std::string two = "--set run.device=cuda --nproc-per-node 2 --set distributed.backend=gloo";
  const std::vector<std::pair<std::string, std::string>> jobs = {
      {"job", ""},
      {"sharded", " --set distributed.sharding=within_node"},
      {"powersgd", " --set distributed.gradient_reduction=powersgd --set distributed.powersgd.start_update=1"
                   " --set distributed.powersgd.min_compression_rate=0 --set distributed.powersgd.rank=128"}};
  for (const auto& [name, extra] : jobs) {
    auto job = run_command(train_prior(dir / name, two + extra));
    ASSERT_EQ(job.status, 0) << name << "\n" << job.output;
    for (int64_t step : {1, 5, 10}) {
      EXPECT_NEAR(metrics_at(dir / name, step)["loss"].get<double>(),
                  metrics_at(dir / "one", step)["loss"].get<double>(), 1e-4)
          << name << ", update " << step;
    }
    if (name == "powersgd") continue;  // compared by its losses, as the CPU test compares it
    EXPECT_LT(largest_difference(weights_at(dir / "one", 10), weights_at(dir / name, 10)), 1e-3) << name;
  }
}

TEST_F(TrainingJob, NcclForAJobOnTheCpuIsRefusedNamingTheKeys) {
  ScratchDir dir;
  auto job = run_command(train_prior(dir / "job", "--set run.device=cpu --set distributed.backend=nccl"));
  EXPECT_NE(job.status, 0);
  EXPECT_THAT(job.output,
              ::testing::HasSubstr("distributed.backend nccl carries CUDA tensors only, but run.device is cpu"));
}

INSTANTIATE_TEST_SUITE_P(Ranks, TrainingJobAtWorldSize, ::testing::Values(2, 4));

// precision.weights bfloat16: the shards of the blocks' matrices and their gradients in 16
// bits, each update rounded stochastically, the average in float32, and each block's input
// kept for its backward in bfloat16 (checkpointed_inputs). It learns as float32
// weights do, and resumes bit for bit on as many ranks (the roundings are drawn per update,
// and the replicated gradients' buckets keep the order they learned, so that 4 ranks sum in
// the uninterrupted run's order); on another number of ranks it reads the same values and
// goes on with other draws.
TEST_F(TrainingJob, ShardedSixteenBitWeightsLearnAndResumeBitForBit) {
  ScratchDir dir;
  // Plateau decay: the learning rate does not depend on run.steps, which the legs change.
  const std::string bf16 = " --set distributed.sharding=within_node --set precision.mode=bfloat16"
                           " --set run.validate_every=5 --set learning_rate.decay=plateau";
  // With DALL-E's 16-bit activations too: the blocks keep their inputs in bfloat16.
  const std::string weights = bf16 + " --set precision.weights=bfloat16 --set checkpointed_inputs=bfloat16";
  for (const auto& [run, arguments] :
       std::vector<std::pair<std::string, std::string>>{{"float32", "--nproc-per-node 4" + bf16},
                                                        {"whole", "--nproc-per-node 4" + weights},
                                                        {"half", "--nproc-per-node 4 --set run.steps=5" + weights},
                                                        {"half", "--nproc-per-node 4" + weights},
                                                        {"other", "--nproc-per-node 2 --set run.steps=5" + weights},
                                                        {"other", "--nproc-per-node 4" + weights}}) {
    auto leg = run_command(train_prior(dir / run, arguments));
    ASSERT_EQ(leg.status, 0) << leg.output;
  }
  EXPECT_EQ(largest_difference(weights_at(dir / "whole", 10), weights_at(dir / "half", 10)), 0.0);
  EXPECT_EQ(validation_at(dir / "whole", 10), validation_at(dir / "half", 10));
  const auto shard = io::read_safetensors(dir / "whole/checkpoints/step-000000010/shard-00001-of-00004.safetensors");
  EXPECT_EQ(shard.tensors.at("weights.0").scalar_type(), torch::kBFloat16) << "the matrices";
  EXPECT_EQ(shard.tensors.at("weights.1").scalar_type(), torch::kFloat32) << "gains and biases";
  EXPECT_EQ(shard.tensors.at("ema.0").scalar_type(), torch::kFloat32);
  // Learning: as float32 weights do, to within a fraction of the loss.
  const double first = metrics_at(dir / "whole", 1)["loss"].get<double>();
  const double last = metrics_at(dir / "whole", 10)["loss"].get<double>();
  EXPECT_LT(last, first);
  EXPECT_NEAR(validation_at(dir / "whole", 10), validation_at(dir / "float32", 10),
              0.01 * validation_at(dir / "float32", 10));
  EXPECT_LT(largest_difference(weights_at(dir / "whole", 10), weights_at(dir / "other", 10)), 0.02)
      << "begun on 2 ranks, resumed on 4: other draws, the same course";
  const auto state = io::load_checkpoint(dir / "half/checkpoints/step-000000005").state;
  EXPECT_FALSE(state.count("reducer.replicated.bucket_order.0")) << "nothing replicated: every array is sharded";
}

// Checkpoints are the usual single-file ones, sharded or not: 4 sharded ranks begin, 2
// data-parallel ranks go on, 2 sharded ranks finish, as one process does in three runs
// (run.steps, which the learning rate's schedule reads, is 5, 8 and 10 in both).
TEST_F(TrainingJob, ShardedAndDataParallelRanksResumeEachOthersCheckpointsOnOtherWorldSizes) {
  ScratchDir dir;
  const std::string sharded = " --set distributed.sharding=within_node";
  // Sharded on 4, on 4 again (each rank reads its own shard file), on 2 (slices of the 4
  // files), data-parallel on 2 (whole), sharded on 2 from that.
  const std::vector<std::pair<int64_t, std::string>> legs{
      {3, "--nproc-per-node 4" + sharded}, {5, "--nproc-per-node 4" + sharded}, {7, "--nproc-per-node 2" + sharded},
      {8, "--nproc-per-node 2"}, {10, "--nproc-per-node 2" + sharded}};
  for (const auto& [steps, job_ranks] : legs) {
    for (const auto& [run, ranks] : {std::pair{std::string("job"), job_ranks}, std::pair{std::string("one"), std::string()}}) {
      auto leg = run_command(train_prior(dir / run, ranks + " --set run.steps=" + std::to_string(steps)));
      ASSERT_EQ(leg.status, 0) << leg.output;
    }
    if (steps != 5) continue;
    for (int64_t rank = 0; rank < 4; ++rank) {
      const auto name = rank == 0 ? std::string("job.log") : "job.rank" + std::to_string(rank) + ".log";
      const auto log = testing::read_text(dir / name);
      EXPECT_THAT(log, ::testing::HasSubstr("rank " + std::to_string(rank) + " of the machine read its part of the "
                                            "resblocks"));
      EXPECT_THAT(log, ::testing::HasSubstr("from the shard file of rank " + std::to_string(rank) + "\n"))
          << "no byte of another rank's shard";
    }
  }
  EXPECT_LT(largest_difference(weights_at(dir / "one", 10), weights_at(dir / "job", 10)), 1e-5);
}

// Fine-tuning sharded: the frozen base is sharded with the blocks, the adapters stay whole on
// every rank. Adapters on a trained prior train as data parallelism trains them, leave the
// base as it was, resume exactly, and their checkpoints hold the adapters alone; Emojich's
// recipe (attention and MLP matrices frozen, the blocks' norms and biases trained in shards)
// in fp16 follows data parallelism's losses; a fresh model with part frozen (no base) resumes
// sharded as data parallelism trains it. Plateau decay: the learning rate does not depend on
// run.steps.
TEST_F(TrainingJob, ShardedFineTuningTrainsAsDataParallelAndWritesOnlyWhatTrains) {
  ScratchDir dir;
  ASSERT_NO_FATAL_FAILURE(train_base(dir / "base"));
  const std::string adapters = " --nproc-per-node 2 --set init_from=" + (dir / "base") +
                               " --set adapter.rank=2 --set adapter.alpha=4 --set learning_rate.peak=1.0e-2"
                               " --set learning_rate.decay=plateau";
  const std::string sharded = " --set distributed.sharding=within_node";
  for (const auto& [run, arguments] : {std::pair{std::string("job"), adapters}, {"sharded", adapters + sharded}}) {
    auto trained = run_command(train_prior(dir / run, arguments));
    ASSERT_EQ(trained.status, 0) << trained.output;
    if (run != "sharded") continue;
    // No rank holds the whole base: each block is read, frozen and cut before the next, and
    // the base it was read from is the one its checkpoints refer to.
    EXPECT_THAT(trained.output, ::testing::HasSubstr("built one resblock at a time, each read from init_from"));
    EXPECT_THAT(trained.output, ::testing::HasSubstr("checkpoints hold what trains and refer to"));
    EXPECT_FALSE(std::filesystem::exists(dir / "sharded/base"));
  }
  const auto tuned = weights_at(dir / "sharded", 10);
  EXPECT_LT(largest_difference(weights_at(dir / "job", 10), tuned), 1e-5);
  const auto started_from = io::inference_weights(io::load_checkpoint(dir / "base/checkpoints/step-000000005"));
  for (const auto& [name, tensor] : tuned) {
    if (name.find(".lora_") == std::string::npos) {
      EXPECT_TRUE(torch::equal(tensor, started_from.at(name))) << name;
    }
  }
  const auto checkpoint = dir / "sharded/checkpoints/step-000000010";
  for (const auto& [name, tensor] : io::read_safetensors(checkpoint + "/model.safetensors").tensors) {
    EXPECT_THAT(name, ::testing::HasSubstr(".lora_")) << "only the adapters are written";
  }
  for (const char* shard : {"/shard-00000-of-00002.safetensors", "/shard-00001-of-00002.safetensors"}) {
    for (const auto& [name, tensor] : io::read_safetensors(checkpoint + shard).tensors) {
      EXPECT_EQ(tensor.numel(), 0) << name << ": the blocks train nothing but their adapters, which stay whole";
    }
  }
  for (const char* steps : {"5", "10"}) {
    auto leg = run_command(train_prior(dir / "resumed", adapters + sharded + " --set run.steps=" + steps));
    ASSERT_EQ(leg.status, 0) << leg.output;
  }
  EXPECT_EQ(largest_difference(tuned, weights_at(dir / "resumed", 10)), 0.0);
  // From the adapter run, whose adapters fold into the base as it loads: the ranks gather the
  // frozen blocks once, into the run's copy of the base, which its checkpoints refer to.
  const std::string again = " --nproc-per-node 2 --set init_from=" + (dir / "sharded") +
                            " --set adapter.rank=2 --set run.steps=5";
  for (const auto& [run, arguments] : {std::pair{std::string("again"), again}, {"again-sharded", again + sharded}}) {
    auto trained = run_command(train_prior(dir / run, arguments));
    ASSERT_EQ(trained.status, 0) << trained.output;
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "again-sharded/base/model.safetensors"));
  EXPECT_LT(largest_difference(weights_at(dir / "again", 5), weights_at(dir / "again-sharded", 5)), 1e-5);
  // The copy, gathered and written one group at a time, holds the folded model bit for bit.
  const auto folded = io::state_dict(*models::load_trained_prior(dir / "sharded").model);
  const auto copy = io::read_safetensors(dir / "again-sharded/base/model.safetensors").tensors;
  EXPECT_EQ(copy.size(), folded.size());
  for (const auto& [name, tensor] : copy) EXPECT_TRUE(torch::equal(tensor, folded.at(name))) << name;
  // The frozen matrices kept in bf16 (frozen_weights) are gathered as such.
  const std::string halved = adapters + " --set precision.mode=bfloat16 --set frozen_weights=bfloat16 --set run.steps=5";
  for (const auto& [run, arguments] : {std::pair{std::string("bf16"), halved}, {"bf16-sharded", halved + sharded}}) {
    auto trained = run_command(train_prior(dir / run, arguments));
    ASSERT_EQ(trained.status, 0) << trained.output;
  }
  EXPECT_NEAR(metrics_at(dir / "bf16-sharded", 5)["loss"].get<double>(),
              metrics_at(dir / "bf16", 5)["loss"].get<double>(), 1e-3);

  const std::string emojich = " --nproc-per-node 2 --set init_from=" + (dir / "base") +
                              " --set 'optimizer.trainable=[\"*embedding*\",\"resblocks.*norm*\",\"to_logits.*\"]'"
                              " --set precision.mode=float16 --set learning_rate.decay=plateau";
  for (const auto& [run, arguments] :
       {std::pair{std::string("emojich"), emojich}, {"emojich-sharded", emojich + sharded}}) {
    auto trained = run_command(train_prior(dir / run, arguments));
    ASSERT_EQ(trained.status, 0) << trained.output;
  }
  for (int64_t step : {1, 5, 10}) {
    EXPECT_NEAR(metrics_at(dir / "emojich-sharded", step)["loss"].get<double>(),
                metrics_at(dir / "emojich", step)["loss"].get<double>(), 1e-5)
        << "update " << step;
  }
  EXPECT_LT(largest_difference(weights_at(dir / "emojich", 10), weights_at(dir / "emojich-sharded", 10)), 1e-3);

  // Without a base (a fresh model with part frozen) the frozen blocks are gathered into every
  // checkpoint's weights file, one group at a time, and a sharded resume takes its frozen
  // shards from there.
  const std::string fresh = " --nproc-per-node 2 --set 'optimizer.trainable=[\"*embedding*\",\"resblocks.*.fc_*\"]'"
                            " --set learning_rate.decay=plateau --set run.checkpoint_every=3";
  auto replicated = run_command(train_prior(dir / "fresh", fresh + " --set run.steps=6"));
  ASSERT_EQ(replicated.status, 0) << replicated.output;
  for (const char* steps : {"3", "6"}) {
    auto leg = run_command(train_prior(dir / "fresh-sharded", fresh + sharded + " --set run.steps=" + steps));
    ASSERT_EQ(leg.status, 0) << leg.output;
  }
  EXPECT_TRUE(io::read_safetensors(dir / "fresh-sharded/checkpoints/step-000000006/model.safetensors")
                  .tensors.count("resblocks.0.qkv.weight"));
  EXPECT_LT(largest_difference(weights_at(dir / "fresh", 6), weights_at(dir / "fresh-sharded", 6)), 1e-5);
}

TEST_F(TrainingJob, TwoRanksTrainSuperResolutionAsOneProcessDoes) {
  ScratchDir dir;
  const std::string train_sr = testing::tool_path("dalle-train-sr") + " --config " + DALLE_SOURCE_DIR +
                               "/configs/superres/fashion-compose-x2-tiny.yaml --set data.train=" +
                               (*data_ / "fc/train") + " --set data.validation=" + (*data_ / "fc/test") +
                               " --set model.num_feat=8 --set model.num_block=1 --set model.num_grow_ch=4" +
                               " --set data.batch_size=4 --set run.threads=1 --set run.steps=10" +
                               " --set run.validate_every=1000000 --set run.checkpoint_every=10 --out ";
  expect_two_ranks_train_as_one_process(train_sr, dir);
}

// Every rank contrasts its images and captions with the whole global batch's.
TEST_F(TrainingJob, TwoRanksTrainClipAsOneProcessDoes) {
  ScratchDir dir;
  testing::write_text(dir / "clip.yaml",
                      "model: {embed_dim: 16, image_size: 16, patch_size: 8, vision_width: 16, vision_layers: 1,\n"
                      "        vision_heads: 2, context_length: 12, vocab_size: 60, text_width: 16, text_layers: 1,\n"
                      "        text_heads: 2}\n"
                      "data: {train: " + (*data_ / "fc/train") + ", validation: " + (*data_ / "fc/test") +
                      ", image_size: 16, batch_size: 8}\n"
                      "tokenizer: " + (*data_ / "tok.model") +
                      "\nrun: {steps: 10, validate_every: 1000000, checkpoint_every: 10, threads: 1}\n");
  expect_two_ranks_train_as_one_process(
      testing::tool_path("dalle-train-clip") + " --config " + (dir / "clip.yaml") + " --out ", dir);
}

TEST_F(TrainingJob, AKilledRankEndsTheJobNamingItAndTheRerunResumesAsIfUninterrupted) {
  ScratchDir dir;
  // 200 updates (about 2 s): the kill lands long before the last.
  const auto job = train_prior(dir / "job", "--nproc-per-node 2 --set run.checkpoint_every=2 --set run.steps=200");
  auto killed = run_command(job + " & pid=$!; " + find_rank_when(dir / "job/checkpoints/step-000000002", 1) +
                            "kill -KILL $rank; " + kWatchdog);
  EXPECT_EQ(killed.status, 1) << killed.output;
  EXPECT_THAT(killed.output, ::testing::HasSubstr("rank 1 was killed by signal 9"));
  EXPECT_THAT(killed.output, ::testing::HasSubstr("the last complete checkpoint is " + (dir / "job/checkpoints/")));
  EXPECT_THAT(killed.output, ::testing::Not(::testing::HasSubstr("terminate called")));

  auto resumed = run_command(job);
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_THAT(resumed.output, ::testing::HasSubstr("resumed from"));
  auto uninterrupted = run_command(
      train_prior(dir / "uninterrupted", "--nproc-per-node 2 --set run.steps=200 --set run.checkpoint_every=200"));
  ASSERT_EQ(uninterrupted.status, 0) << uninterrupted.output;
  EXPECT_EQ(largest_difference(weights_at(dir / "uninterrupted", 200), weights_at(dir / "job", 200)), 0.0);
}

// A rank that stops answering (SIGSTOP) is found by its silent heartbeat once the others'
// collective times out (3 s here).
TEST_F(TrainingJob, AHangingRankIsNamedWhenTheOthersTimeOut) {
  ScratchDir dir;
  const auto start = std::chrono::steady_clock::now();
  auto hung = run_command(train_prior(dir / "job", "--nproc-per-node 2 --set run.checkpoint_every=2") +
                          " --set run.steps=1000000 --set distributed.timeout_seconds=3 & pid=$!; " +
                          find_rank_when(dir / "job/checkpoints/step-000000002", 1) + "kill -STOP $rank; " +
                          kWatchdog);
  EXPECT_EQ(hung.status, 1) << hung.output;
  EXPECT_THAT(hung.output, ::testing::HasSubstr("rank 0: all_reduce failed: rank 1 stopped answering"));
  EXPECT_THAT(hung.output, ::testing::HasSubstr("the last complete checkpoint is"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(40));
}

// A 2-rank job in `dir`/job, sent `kill` (a shell command on $pid, the launcher, or $rank,
// rank 1) once its first metrics line is out; what the launcher printed and returned.
testing::Result stop_a_job(const ScratchDir& dir, const std::string& kill) {
  const auto job = TrainingJob::train_prior(dir / "job", "--nproc-per-node 2 --set run.checkpoint_every=1000000");
  return run_command(job + " --set run.steps=1000000 & pid=$!; " + find_rank_when(dir / "job/metrics.jsonl", 1) +
                     kill + "; " + kWatchdog);
}

TEST_F(TrainingJob, SigtermToOneRankStopsEveryRankAfterTheSameUpdateWithOneCheckpoint) {
  ScratchDir dir;
  const auto job = train_prior(dir / "job", "--nproc-per-node 2 --set run.checkpoint_every=1000000");
  auto stopped = stop_a_job(dir, "kill -TERM $rank");
  EXPECT_EQ(stopped.status, 143) << stopped.output;
  EXPECT_THAT(stopped.output, ::testing::Not(::testing::HasSubstr("error")));
  std::vector<std::string> checkpoints;
  for (const auto& entry : std::filesystem::directory_iterator(dir / "job/checkpoints")) {
    if (entry.is_directory()) checkpoints.push_back(entry.path().filename().string());
  }
  ASSERT_EQ(checkpoints.size(), 1u);
  const int64_t at = std::stoll(checkpoints[0].substr(5));
  const auto said = "stopped after update " + std::to_string(at) + " of";
  EXPECT_THAT(testing::read_text(dir / "job.log"), ::testing::HasSubstr(said));
  EXPECT_THAT(testing::read_text(dir / "job.rank1.log"),
              ::testing::HasSubstr("stopped by SIGTERM after update " + std::to_string(at) + " of"));
  auto resumed = run_command(job + " --set run.steps=" + std::to_string(at + 2));
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_THAT(resumed.output, ::testing::HasSubstr("at update " + std::to_string(at)));
}

// ^C reaches the launcher alone (the ranks have process groups of their own): it passes
// SIGINT on once, every rank stops after the same update, and the launcher exits 130.
TEST_F(TrainingJob, SigintToTheLauncherStopsEveryRankOnce) {
  ScratchDir dir;
  auto stopped = stop_a_job(dir, "kill -INT $pid");
  EXPECT_EQ(stopped.status, 130) << stopped.output;
  EXPECT_THAT(testing::read_text(dir / "job.log"), ::testing::HasSubstr("stopped by SIGINT after update"));
  EXPECT_THAT(testing::read_text(dir / "job.rank1.log"), ::testing::HasSubstr("stopped by SIGINT after update"));
  EXPECT_EQ(io::CheckpointStore(dir / "job/checkpoints").steps().size(), 1u);
}

// `timeout` sends SIGTERM to the launcher and again to its process group: the second is the
// same request, not the "end them now" of a second ^C, so the ranks still checkpoint.
TEST_F(TrainingJob, ARepeatedSigtermToTheLauncherStillStopsEveryRankWithACheckpoint) {
  ScratchDir dir;
  auto stopped = stop_a_job(dir, "kill -TERM $pid; sleep 0.05; kill -TERM $pid");
  EXPECT_EQ(stopped.status, 143) << stopped.output;
  EXPECT_THAT(testing::read_text(dir / "job.rank1.log"), ::testing::HasSubstr("stopped by SIGTERM after update"));
  EXPECT_EQ(io::CheckpointStore(dir / "job/checkpoints").steps().size(), 1u);
}

// A port nobody listens on now, for ranks started by hand.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

// The command that runs `train` (a command line) as 4 ranks on two "machines" of two,
// started as torchrun starts them on each, and fails unless every rank succeeds.
std::string on_two_machines_of_two(const std::string& train) {
  const std::string env = "WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                          std::to_string(free_port());
  std::string ranks = "pids=; ";
  for (int rank = 0; rank < 4; ++rank) {
    ranks += env + " RANK=" + std::to_string(rank) + " LOCAL_RANK=" + std::to_string(rank % 2) + " GROUP_RANK=" +
             std::to_string(rank / 2) + " " + train + " & pids=\"$pids $!\"; ";
  }
  return ranks + "status=0; for p in $pids; do wait $p || status=1; done; exit $status";
}

// The run `arguments` describe on two "machines" of two, uninterrupted into DIR/whole and in
// two legs (stopped at update 5, then resumed) into DIR/resumed; returns the legs' outputs.
using TrainCommand = std::function<std::string(const std::string& run, const std::string& arguments)>;
std::vector<std::string> train_whole_and_resumed(const ScratchDir& dir, const TrainCommand& train,
                                                 const std::string& arguments) {
  auto whole = run_command(on_two_machines_of_two(train(dir / "whole", arguments)));
  EXPECT_EQ(whole.status, 0) << whole.output;
  std::vector<std::string> legs;
  for (const char* steps : {"5", "10"}) {
    auto leg = run_command(on_two_machines_of_two(train(dir / "resumed", arguments + " --set run.steps=" + steps)));
    EXPECT_EQ(leg.status, 0) << leg.output;
    legs.push_back(leg.output);
  }
  return legs;
}

// Two "machines" of two ranks: every resblock is sharded between the ranks of a machine and
// replicated across the machines (DALL-E's hybrid layout), and the job trains as 4
// data-parallel ranks do.
TEST_F(TrainingJob, TwoMachinesOfTwoRanksShardWithinAndReplicateAcross) {
  ScratchDir dir;
  auto data_parallel = run_command(train_prior(dir / "job", "--nproc-per-node 4"));
  ASSERT_EQ(data_parallel.status, 0) << data_parallel.output;
  auto hybrid =
      run_command(on_two_machines_of_two(train_prior(dir / "hybrid", "--set distributed.sharding=within_node")));
  ASSERT_EQ(hybrid.status, 0) << hybrid.output;
  EXPECT_THAT(hybrid.output, ::testing::HasSubstr("each holds 1/2 of their weights, gradients and moments, "
                                                  "replicated on the 2 machines"));
  EXPECT_LT(largest_difference(weights_at(dir / "job", 10), weights_at(dir / "hybrid", 10)), 1e-5);
}

// DALL-E's hierarchy on two "machines" of two ranks: reduce-scatter within the machine,
// PowerSGD on each shard across the machines. At full rank it trains as data parallelism
// (its losses; the 1e-6 I added before QR moves near-zero gradients, which AdamW amplifies);
// at rank 2 it learns, its checkpoints carry the shards' error feedback, and a run stopped
// at update 5 and resumed takes the updates of an uninterrupted one.
TEST_F(TrainingJob, ShardedPowerSgdAcrossMachinesTrainsAsDataParallelAtFullRankAndResumesExactly) {
  ScratchDir dir;
  const std::string powersgd = "--set distributed.sharding=within_node --set distributed.gradient_reduction=powersgd"
                               " --set distributed.powersgd.start_update=1 --set distributed.powersgd.min_compression_rate=0"
                               " --set learning_rate.decay=plateau";
  auto full = run_command(on_two_machines_of_two(train_prior(dir / "full", powersgd + " --set distributed.powersgd.rank=128")));
  ASSERT_EQ(full.status, 0) << full.output;
  auto plain = run_command(train_prior(dir / "plain", "--nproc-per-node 4 --set learning_rate.decay=plateau"));
  ASSERT_EQ(plain.status, 0) << plain.output;
  for (int64_t step = 1; step <= 10; ++step) {
    EXPECT_NEAR(metrics_at(dir / "full", step)["loss"].get<double>(), metrics_at(dir / "plain", step)["loss"].get<double>(),
                1e-4)
        << "update " << step;
  }

  const std::string low = powersgd + " --set distributed.powersgd.rank=2";
  train_whole_and_resumed(dir, train_prior, low);
  ASSERT_FALSE(HasFailure());
  EXPECT_GT(largest_difference(weights_at(dir / "plain", 10), weights_at(dir / "whole", 10)), 1e-4) << "compressed";
  EXPECT_LT(metrics_at(dir / "whole", 10)["loss"].get<double>(), metrics_at(dir / "whole", 1)["loss"].get<double>());
  const auto state = io::load_checkpoint(dir / "resumed/checkpoints/step-000000005").state;
  EXPECT_TRUE(state.count("reducer.error.resblocks.0.qkv.weight")) << "the shards' error feedback, whole";
  EXPECT_EQ(state.at("reducer.updates").item<int64_t>(), 5);
  EXPECT_LT(largest_difference(weights_at(dir / "whole", 10), weights_at(dir / "resumed", 10)), 1e-5);
}

// A sharded run from init_from builds its prior one block at a time, each read from the
// base's moving average and cut before the next exists (no rank holds the whole prior), and
// trains as data parallelism does from the same start.
TEST_F(TrainingJob, ShardedFromInitFromIsReadBlockByBlockAndTrainsAsDataParallel) {
  ScratchDir dir;
  ASSERT_NO_FATAL_FAILURE(train_base(dir / "base"));
  const std::string tuned =
      " --nproc-per-node 2 --set init_from=" + (dir / "base") + " --set learning_rate.decay=plateau";
  for (const auto& [run, arguments] : {std::pair{std::string("job"), tuned},
                                       {"sharded", tuned + " --set distributed.sharding=within_node"}}) {
    auto trained = run_command(train_prior(dir / run, arguments));
    ASSERT_EQ(trained.status, 0) << trained.output;
  }
  EXPECT_THAT(testing::read_text(dir / "sharded.log"),
              ::testing::HasSubstr("built one resblock at a time, each read from init_from"));
  EXPECT_LT(largest_difference(weights_at(dir / "job", 10), weights_at(dir / "sharded", 10)), 1e-5);
  const auto started_from = io::inference_weights(io::load_checkpoint(dir / "base/checkpoints/step-000000005"));
  EXPECT_FALSE(torch::equal(weights_at(dir / "sharded", 10).at("to_logits.weight"), started_from.at("to_logits.weight")))
      << "it trains";

  // Adapters on a sharded checkpoint: its shards are read one group at a time, never joined
  // whole, for the start and for a resume (the frozen blocks, from the base the checkpoints
  // refer to): the same updates, bit for bit, as adapters on its export (the same values,
  // written whole) trained without a stop.
  auto exported =
      run_command(testing::tool_path("dalle-export") + " " + (dir / "sharded") + " --out " + (dir / "export"));
  ASSERT_EQ(exported.status, 0) << exported.output;
  const std::string adapters = " --nproc-per-node 2 --set distributed.sharding=within_node --set adapter.rank=2"
                               " --set learning_rate.decay=plateau --set init_from=";
  auto started = run_command(train_prior(dir / "from-shards", adapters + (dir / "sharded") + " --set run.steps=5"));
  ASSERT_EQ(started.status, 0) << started.output;
  EXPECT_THAT(started.output, ::testing::HasSubstr("each read from init_from's shard files"));
  EXPECT_THAT(started.output, ::testing::HasSubstr("refer to " + (dir / "sharded/checkpoints/step-000000010")));
  auto resumed = run_command(train_prior(dir / "from-shards", adapters + (dir / "sharded")));
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_THAT(resumed.output, ::testing::HasSubstr("read its part of the frozen blocks from the base's shard files"));
  auto whole = run_command(train_prior(dir / "from-export", adapters + (dir / "export")));
  ASSERT_EQ(whole.status, 0) << whole.output;
  EXPECT_THAT(whole.output, ::testing::Not(::testing::HasSubstr("shard files")));
  EXPECT_EQ(largest_difference(weights_at(dir / "from-shards", 10), weights_at(dir / "from-export", 10)), 0.0);
}

// Fine-tuning in DALL-E's hierarchy: the MLP matrices train (in shards, compressed across the
// machines), attention stays frozen (sharded, never reduced). The frozen weights stay as they
// were, and a run stopped at update 5 and resumed takes the updates of an uninterrupted one.
TEST_F(TrainingJob, ShardedPowerSgdFineTuningLeavesTheFrozenBlocksAndResumesExactly) {
  ScratchDir dir;
  ASSERT_NO_FATAL_FAILURE(train_base(dir / "base"));
  const std::string tune = "--set init_from=" + (dir / "base") +
                           " --set 'optimizer.trainable=[\"*embedding*\",\"resblocks.*.fc_*\",\"to_logits.*\"]'"
                           " --set distributed.sharding=within_node --set distributed.gradient_reduction=powersgd"
                           " --set distributed.powersgd.start_update=1 --set distributed.powersgd.rank=2"
                           " --set distributed.powersgd.min_compression_rate=0 --set learning_rate.decay=plateau";
  train_whole_and_resumed(dir, train_prior, tune);
  ASSERT_FALSE(HasFailure());
  const auto tuned = weights_at(dir / "whole", 10);
  EXPECT_LT(largest_difference(tuned, weights_at(dir / "resumed", 10)), 1e-5);
  const auto started_from = io::inference_weights(io::load_checkpoint(dir / "base/checkpoints/step-000000005"));
  for (const char* name : {"resblocks.0.qkv.weight", "resblocks.2.out.weight"}) {
    EXPECT_TRUE(torch::equal(tuned.at(name), started_from.at(name))) << name << " is frozen";
  }
  EXPECT_FALSE(torch::equal(tuned.at("resblocks.1.fc_in.weight"), started_from.at("resblocks.1.fc_in.weight")));
  const auto state = io::load_checkpoint(dir / "resumed/checkpoints/step-000000005").state;
  EXPECT_TRUE(state.count("reducer.error.resblocks.1.fc_in.weight")) << "the trained shards' error feedback";
  EXPECT_FALSE(state.count("reducer.error.resblocks.0.qkv.weight")) << "none for the frozen";
}

// Warm-started Q under sharding: each rank keeps its blocks' Q in its shard file, so that a
// resume on as many ranks per machine continues the same power iterations (a resume that left
// Q out would restart them from the seeded Gaussian and end elsewhere).
TEST_F(TrainingJob, ShardedPowerSgdWithWarmQResumesExactly) {
  ScratchDir dir;
  const std::string warm = "--set distributed.sharding=within_node --set distributed.gradient_reduction=powersgd"
                           " --set distributed.powersgd.start_update=1 --set distributed.powersgd.min_compression_rate=0"
                           " --set distributed.powersgd.rank=2 --set distributed.powersgd.warm_start=true"
                           " --set learning_rate.decay=plateau";  // a schedule that run.steps leaves alone
  for (const auto& leg : train_whole_and_resumed(dir, train_prior, warm)) {
    EXPECT_THAT(leg, ::testing::Not(::testing::HasSubstr("warm Q starts afresh")));
  }
  ASSERT_FALSE(HasFailure());
  EXPECT_TRUE(io::read_safetensors(dir / "resumed/checkpoints/step-000000005/shard-00001-of-00002.safetensors")
                  .tensors.count("powersgd_q.0.0"));
  EXPECT_LT(largest_difference(weights_at(dir / "whole", 10), weights_at(dir / "resumed", 10)), 1e-6);
}

// DALL-E's 12B settings on two "machines" of two ranks: fp16 with per-resblock scales,
// bfloat16 weights, moments and PowerSGD state, rank 2 per shard. Each shard's gradient is
// accumulated straight into its error buffer (at the backward's scales) and decompressed only
// as AdamW takes it: the run learns without a skipped update, and a run stopped at update 5
// and resumed goes on from the error feedback its checkpoint keeps. (Not bit for bit: the
// checkpoint keeps the machines' mean of the feedback, DALL-E's sum, which enters the next
// averages as each machine's own does up to rounding, and a last-bit difference moves a
// stochastic rounding of a bfloat16 weight by one step.)
TEST_F(TrainingJob, ShardedPowerSgdInDallEsSixteenBitsLearnsAndResumes) {
  ScratchDir dir;
  const std::string dalle = "--set distributed.sharding=within_node --set distributed.gradient_reduction=powersgd"
                            " --set distributed.powersgd.start_update=1 --set distributed.powersgd.min_compression_rate=0"
                            " --set distributed.powersgd.rank=2 --set distributed.powersgd.dtype=bfloat16"
                            " --set precision.mode=float16 --set precision.weights=bfloat16"
                            " --set precision.adam_moments=bfloat16 --set learning_rate.decay=plateau";
  train_whole_and_resumed(dir, train_prior, dalle);
  ASSERT_FALSE(HasFailure());
  EXPECT_LT(metrics_at(dir / "whole", 10)["loss"].get<double>(), metrics_at(dir / "whole", 1)["loss"].get<double>());
  EXPECT_EQ(metrics_at(dir / "whole", 10)["skipped_updates"].get<int64_t>(), 0);
  const double resumed = largest_difference(weights_at(dir / "whole", 10), weights_at(dir / "resumed", 10));
  std::printf("resumed at update 5: the weights at 10 differ by %.2e at most\n", resumed);
  EXPECT_LT(resumed, 2e-3);
  const auto state = io::load_checkpoint(dir / "resumed/checkpoints/step-000000005").state;
  ASSERT_TRUE(state.count("reducer.error.resblocks.0.qkv.weight"));
  EXPECT_GT(state.at("reducer.error.resblocks.0.qkv.weight").abs().max().item<double>(), 0.0) << "carried";
}

// DALLE_MEMORY_PHASES logs each phase's own peak resident memory (docs/benchmarks.md): the
// start, each update, validation and checkpoint, the high-water mark reset at each; a
// resumed run's start includes its resume. Without it, no such line.
TEST_F(TrainingJob, MemoryPhasesAreLoggedWhenAsked) {
  ScratchDir dir;
  const std::string sharded = "--nproc-per-node 2 --set distributed.sharding=within_node --set run.validate_every=2";
  auto plain = run_command(train_prior(dir / "plain", sharded + " --set run.steps=2"));
  ASSERT_EQ(plain.status, 0) << plain.output;
  EXPECT_THAT(plain.output, ::testing::Not(::testing::HasSubstr("memory phase")));
  auto first = run_command("DALLE_MEMORY_PHASES=1 " + train_prior(dir / "run", sharded + " --set run.steps=2"));
  ASSERT_EQ(first.status, 0) << first.output;
  const auto peak_of = [](const std::string& output, const std::string& phase) {
    const auto at = output.find("memory phase " + phase);
    if (at == std::string::npos) return -1.0;
    const auto peak = output.find(": peak ", at);
    return std::stod(output.substr(peak + 7));
  };
  for (const char* phase : {"start at update 0", "update at update 1", "update at update 2", "validation at update 2",
                            "checkpoint at update 2"}) {
    EXPECT_GT(peak_of(first.output, phase), 0.0) << phase << "\n" << first.output;
  }
  auto resumed = run_command("DALLE_MEMORY_PHASES=1 " + train_prior(dir / "run", sharded + " --set run.steps=3"));
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_GT(peak_of(resumed.output, "start at update 2"), 0.0) << "the resume's peak\n" << resumed.output;
}

// Ranks started as torchrun starts them (its variables), one with another recipe.
TEST_F(TrainingJob, RanksStartedWithDifferentConfigsRefuseToStart) {
  ScratchDir dir;
  const std::string env = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                          std::to_string(free_port());
  auto result = run_command(env + " RANK=0 LOCAL_RANK=0 " + train_prior(dir / "job") + " > " + (dir / "rank0.txt") +
                            " 2>&1 & " + env + " RANK=1 LOCAL_RANK=1 " +
                            train_prior(dir / "job", "--set optimizer.beta1=0.8") + "; status=$?; wait; exit $status");
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("rank 1: the ranks of this job differ from rank 0 in their config (rank 1)"));
  EXPECT_THAT(testing::read_text(dir / "rank0.txt"), ::testing::HasSubstr("differ from rank 0 in their config"));
  EXPECT_FALSE(std::filesystem::exists(dir / "job/checkpoints/step-000000005"));
}

}  // namespace
}  // namespace dalle
