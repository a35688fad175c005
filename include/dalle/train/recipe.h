#pragma once
// The sections every training recipe shares, declared once and read under the same keys by
// every trainer: `optimizer` (AdamW, clipping, the moving average of the weights), `run`
// (how long, how often, where), `precision` (train/precision.h) and `distributed`. Each trainer gives its
// own defaults (the paper's or the reference's), not its own keys.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/distributed/powersgd.h"
#include "dalle/train/precision.h"

namespace dalle::train {

struct OptimizerConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double epsilon = 1e-8;
  double weight_decay = 0.0;
  double grad_clip = 0.0;  // 0: no clipping
  double ema_decay = 0.999;
  // Glob patterns over parameter names; those matching none are frozen. Empty: all train.
  std::vector<std::string> trainable;

  void visit(ConfigVisitor& v);
};

struct RunConfig {
  int64_t steps = 1000;
  int64_t log_every = 100;
  int64_t validate_every = 1000;
  int64_t checkpoint_every = 1000;
  int64_t keep_checkpoints = 3;
  int64_t seed = 0;
  int64_t threads = 0;
  std::string device = "auto";

  void visit(ConfigVisitor& v);
};

// PowerSGD's choices (distributed/powersgd.h).
struct PowerSgdConfig {
  int64_t rank = 4;
  int64_t start_update = 1000;
  double min_compression_rate = 2.0;
  bool warm_start = true;
  std::string dtype = "float32";  // of P, Q and the error buffers: float32, bfloat16 or float16

  void visit(ConfigVisitor& v);
};

// How the processes of a job (distributed/job.h) train together. Every key may change on resume.
struct DistributedConfig {
  int64_t nproc_per_node = 1;  // >1: fork this many ranks on 127.0.0.1 when no launcher started the process
  double timeout_seconds = 300;
  double bucket_megabytes = 25;
  std::string sharding = "none";  // "within_node": ZeRO-3 resblocks (the prior only)
  std::string gradient_reduction = "allreduce";  // or "powersgd"
  std::string backend = "auto";  // c10d's: auto (NCCL on GPUs, gloo on the CPU), gloo or nccl
  bool overlap = true;  // gradients averaged while backward runs
  // Sharded: when a block's backward starts gathering the block before it (FSDP's backward_prefetch).
  std::string backward_prefetch = "before_gradients";  // or "after_gradients"
  std::string simulated_link;  // "gbps,latency_ms": every collective across machines delayed as on that link
  PowerSgdConfig powersgd;

  void visit(ConfigVisitor& v);
};

// distributed.bucket_megabytes in bytes, as the reducers take it.
int64_t bucket_bytes(const DistributedConfig& config);
// distributed.powersgd as the reducers take it (the first Q seeded by run.seed) when
// distributed.gradient_reduction is powersgd; none otherwise.
std::optional<distributed::PowerSgdOptions> powersgd_options(const DistributedConfig& config, const RunConfig& run);

// What every recipe holds beyond its model and data, in these sections.
struct SharedSections {
  OptimizerConfig& optimizer;
  RunConfig& run;
  PrecisionConfig& precision;
  DistributedConfig& distributed;
};

// Visits the shared sections, and refuses a recipe that still has their keys at the top
// level (as recipes had them before the sections), naming the key's new place.
void visit_shared_sections(ConfigVisitor& v, const SharedSections& sections);

// The keys a resume may change in every recipe: how long and how often, the threads, the
// loader's workers, the device and the distributed settings, not what is trained.
bool is_run_control_key(const std::string& key);

}  // namespace dalle::train
