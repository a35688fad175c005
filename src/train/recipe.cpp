#include "dalle/train/recipe.h"

#include <cmath>

#include "dalle/device.h"

namespace dalle::train {

void OptimizerConfig::visit(ConfigVisitor& v) {
  v.field("beta1", beta1, "AdamW's first-moment decay", {.min = 0.0, .max = 1.0});
  v.field("beta2", beta2, "AdamW's second-moment decay", {.min = 0.0, .max = 1.0});
  v.field("epsilon", epsilon, "AdamW's epsilon", {.min = 0.0});
  v.field("weight_decay", weight_decay, "AdamW's decoupled weight decay (0: Adam)", {.min = 0.0});
  v.field("grad_clip", grad_clip, "clip the global gradient norm to this (0: no clipping)", {.min = 0.0});
  v.field("ema_decay", ema_decay, "decay of the weights' moving average, which validates and is exported (0: off)",
          {.min = 0.0, .max = 0.999999});
  v.field("trainable", trainable,
          "glob patterns over parameter names (`*` any text, dots included: \"resblocks.*.qkv.*\", "
          "\"*embedding*\"); parameters matching none are frozen: no gradients, no AdamW moments, no reduction "
          "(fine-tuning part of a model, as ruDALL-E's Emojich froze attention and MLP). Empty: every parameter "
          "trains. A pattern that matches nothing is refused; names: the model's state dict");
}

void RunConfig::visit(ConfigVisitor& v) {
  v.field("steps", steps, "updates to train for", {.min = 1});
  v.field("log_every", log_every, "updates between metric lines", {.min = 1});
  v.field("validate_every", validate_every, "updates between validations", {.min = 1});
  v.field("checkpoint_every", checkpoint_every, "updates between checkpoints", {.min = 1});
  v.field("keep_checkpoints", keep_checkpoints, "checkpoints kept (0: all)", {.min = 0});
  v.field("seed", seed, "seed of the initialisation, the data order and every random draw of training", {.min = 0});
  v.field("threads", threads, "CPU threads for torch (0: one per idle core)", {.min = 0, .max = 1024});
  v.field("device", device, "where training runs: auto (a GPU when torch sees one), cpu or cuda",
          {.choices = {"auto", "cpu", "cuda"}});
}

void PowerSgdConfig::visit(ConfigVisitor& v) {
  v.field("rank", rank,
          "r: each gradient matrix is averaged as P (n x r) Q^T (m x r); sharded, each shard's rows of it (DALL-E 12B: "
          "896 over 8 shards, 112 here)",
          {.min = 1, .max = 65536});
  v.field("start_update", start_update, "updates before this one average whole gradients (PyTorch's hook: 1000)",
          {.min = 1});
  v.field("min_compression_rate", min_compression_rate,
          "compress a matrix only when n m > this x (n + m) r; the others go whole", {.min = 0.0, .max = 1e6});
  v.field("warm_start", warm_start,
          "true: the last Q starts the next power iteration (PyTorch's hook; sharded, each rank's blocks of rows "
          "keep theirs, in its shard file of the checkpoints, and start afresh on another number of ranks per "
          "machine); false: Q stays the first seeded Gaussian (DALL-E), kept in `dtype`. On by default: at rank 32 "
          "it ended 0.6% above plain reduction's validation loss where a fixed Q ended 1.2% above "
          "(docs/distributed.md)");
  v.field("dtype", dtype,
          "of P and Q on the wire, of the error buffers and of a fixed Q: float32, or 16 bits as DALL-E kept them "
          "(bfloat16 has fp32's range; float16's infinities are clamped to 65504, and unscaled gradients below "
          "6e-8 vanish)",
          dtype_choices({"float32", "bfloat16", "float16"}));
}

void DistributedConfig::visit(ConfigVisitor& v) {
  v.field("nproc_per_node", nproc_per_node,
          "ranks to fork on this machine (127.0.0.1) when no launcher (torchrun, mpirun, srun) started the tool; "
          "data.batch_size is the global batch, split evenly between them",
          {.min = 1, .max = 1024});
  v.field("timeout_seconds", timeout_seconds,
          "how long a rank waits for the others (to join, in a collective) before the job fails naming the wait",
          {.min = 1.0, .max = 86400.0});
  v.field("bucket_megabytes", bucket_megabytes, "gradient bytes per all-reduce of data parallelism",
          {.min = 0.001, .max = 4096.0});
  v.field("sharding", sharding,
          "none: every rank holds the whole model; within_node (the prior): each rank of a machine holds 1/N of "
          "every parameter array (each resblock, the embeddings, the head) with its gradients and AdamW moments, "
          "gathered per block (ZeRO-3, DALL-E's layout; implies per-resblock activation checkpointing); on one "
          "rank, the same layout as one shard: 16-bit precision.weights, no whole validation copy",
          {.choices = {"none", "within_node"}});
  v.field("gradient_reduction", gradient_reduction,
          "allreduce: the gradients averaged whole; powersgd: each matrix averaged as a low-rank product with error "
          "feedback, between every rank (sharding none) or, sharded, on each shard between machines (DALL-E)",
          {.choices = {"allreduce", "powersgd"}});
  v.field("backend", backend,
          "c10d's backend for the collectives: auto (NCCL when run.device is a GPU, gloo on the CPU), gloo (also "
          "for CUDA tensors, through the host: several ranks may then share one GPU) or nccl (GPUs only, one "
          "each)",
          {.choices = {"auto", "gloo", "nccl"}});
  v.field("overlap", overlap,
          "true: each bucket of gradients is averaged (each resblock's reduce-scatter, sharded) as soon as backward "
          "has made it, while backward goes on (sharded: while the next resblock gathers and recomputes, complete "
          "before it makes its gradients, so no more memory is held); false: after backward (sharded: each "
          "resblock's before backward goes on). The same bytes are summed either way: the weights are identical");
  v.field("backward_prefetch", backward_prefetch,
          "sharded: when a resblock's backward starts gathering the resblock it reaches next (FSDP's "
          "backward_prefetch). before_gradients: while this one's gradients are made, which hides the gather but "
          "holds it beside this one's values and gradients; after_gradients: once they are made and handed to their "
          "reduce-scatter, which holds a block less with fp32 weights but leaves the gather unhidden (slower "
          "steps where communication is slow). dalle-plan counts both; the weights are identical",
          {.choices = {"before_gradients", "after_gradients"}});
  v.field("simulated_link", simulated_link,
          "for measurements: 'gbps,latency_ms' (for instance '10,0.5') delays every collective between machines "
          "(between all ranks on one machine) as such a link would; empty: none");
  v.section("powersgd", "PowerSGD's rank and choices (distributed.gradient_reduction powersgd)", powersgd);
}

int64_t bucket_bytes(const DistributedConfig& config) { return std::llround(config.bucket_megabytes * (1 << 20)); }

std::optional<distributed::PowerSgdOptions> powersgd_options(const DistributedConfig& config, const RunConfig& run) {
  if (config.gradient_reduction != "powersgd") return std::nullopt;
  const auto& p = config.powersgd;
  return distributed::PowerSgdOptions{.rank = p.rank,
                                      .start_update = p.start_update,
                                      .min_compression_rate = p.min_compression_rate,
                                      .warm_start = p.warm_start,
                                      .dtype = float_type_named(p.dtype),
                                      .seed = static_cast<uint64_t>(run.seed),
                                      .bucket_bytes = bucket_bytes(config)};
}

void visit_shared_sections(ConfigVisitor& v, const SharedSections& sections) {
  v.section("optimizer", "AdamW, gradient clipping and the moving average of the weights", sections.optimizer);
  v.section("run", "how long, how often and where the run trains", sections.run);
  v.section("precision", "fp32, bf16, or fp16 with dynamic gradient scales (per resblock in the prior)",
            sections.precision);
  v.section("distributed", "training across processes and machines (docs/distributed.md)", sections.distributed);
  for (const char* key : {"beta1", "beta2", "epsilon", "weight_decay", "grad_clip", "ema_decay"}) {
    v.moved(key, std::string("optimizer.") + key);
  }
  for (const char* key :
       {"steps", "log_every", "validate_every", "checkpoint_every", "keep_checkpoints", "seed", "threads", "device"}) {
    v.moved(key, std::string("run.") + key);
  }
}

bool is_run_control_key(const std::string& key) {
  return key == "run.steps" || key == "run.log_every" || key == "run.validate_every" ||
         key == "run.checkpoint_every" || key == "run.keep_checkpoints" || key == "run.threads" ||
         key == "data.workers" || key == "run.device" || key.starts_with("distributed.");
}

}  // namespace dalle::train
