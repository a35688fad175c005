#pragma once
// A capacity plan for training the prior (dalle-plan): from a dalle-train recipe and a
// cluster's shape, what each rank holds in memory, what it hands to collectives per update,
// the model FLOPs per update, a predicted step time, and whether it fits.
//
// Counted exactly, as the code does it:
// - Parameters: one layer of the model is built on the CPU and its two resblocks counted
//   `layers` times, the embeddings and output layer once, so the counts are the real model's.
// - State per rank: fp32 weights, fp32 gradients, AdamW's two moments in
//   precision.adam_moments, the fp32 moving average, and the whole fp32 model every rank
//   keeps for validation (the trainer's ema_model). Fine-tuning with frozen parameters
//   (optimizer.trainable, adapter): the weights (adapters included) stay whole, gradients,
//   moments, average and the validation copy count only what trains (the validation model
//   shares the frozen weights), measured by freezing one layer built on the CPU as the
//   trainer does; activations are counted as in full training (an upper bound: a frozen
//   layer's input is not kept for its weight's gradient). Not planned with frozen parameters:
//   sharding (refused by the trainer too) and PowerSGD. Sharded (distributed.sharding within_node
//   on more than one GPU per machine), each resblock is two groups (its matrices, the rest),
//   each cut into ceil(values / GPUs) per rank, padding included; the rest stays whole.
// - Bytes per update: the payload each rank hands to a collective, as the counters count it:
//   DataParallelReducer::bytes_reduced (the fp32 gradients), ShardedParameters::bytes_moved
//   (each group gathered whole twice, forward and backward, and reduce-scattered whole once),
//   ShardedReducer::bytes_across_nodes and LowRankAverager's P and Q (in powersgd.dtype).
//   PowerSGD is counted once compressing (after powersgd.start_update); before, everything
//   goes whole, as `bytes_across_uncompressed` says.
//
// Estimated, by simple documented rules:
// - Activations per rank, with T = tokens per rank (batch per rank x sequence), d = width, R =
//   resblocks (2 x layers) and b = 2 bytes in fp16/bf16, 4 in fp32:
//   every resblock's input, R x T x d x 4 (the residual stream is fp32; with per-resblock
//   checkpointing these are all that is kept); each resblock that is not checkpointed also
//   keeps its internals, 6 T d b for attention (norm, q, k, v, attended) and 10 T d b for the
//   MLP (norm, the 4d hidden before and after GELU), and a checkpointed one recomputes them
//   one block at a time (the MLP's, the larger, counted once); the logits, fp32 values,
//   log-softmax and gradient, T x classes x 12. Attention scores are not kept (SDPA's
//   memory-efficient kernel, the sparse path's blocks). Sharding implies per-resblock
//   checkpointing, as in the trainer; else checkpoint_activations_every k checkpoints
//   resblocks 0, k, 2k, ... With the benchmark's state (fp32 weights, gradients and moments,
//   no average), the rule gives the 1.3B layout's measured peaks on an H100 (docs/benchmarks.md:
//   bf16, batch 8, 42.1 GiB without checkpointing, 24.6 GiB with every resblock's) within -2%
//   and +5%.
// - 16-bit weight copies: autocast casts a block's fp32 weights to 16 bits, and keeps the
//   copies of every block whose activations are kept.
// - Peak memory = what is kept between updates + the larger of two phases: backward
//   (activations, logits, weight copies, a gathered block and the next one prefetched) and
//   the gradient reduction (PowerSGD's P and Q, and in 16 bits its fp32 working copies).
//   Allocator fragmentation, CUDA's context and library workspaces are not counted.
// - Step time = compute + communication not hidden. Compute: model FLOPs (models/prior_flops.h)
//   of the rank's tokens at `mfu` of `peak_tflops` (recomputation is inside the MFU).
//   Communication on rings: all-reduce sends 2(N-1)/N of its payload per rank,
//   all-gather and reduce-scatter (N-1)/N of the whole (the counters' payload); a collective
//   within a machine runs at `link_within_gbps`; one across machines, made by all GPUs of a
//   machine at once (one group per local rank), shares the machine's `link_across_gbps`; a
//   flat one over every rank is held back by the slower of the two. Latency is not modelled.
//   Hidden, up to the compute time: the sharded blocks' gathers (prefetched one block
//   ahead) and, with distributed.overlap, what starts during backward (data parallelism's
//   buckets, PowerSGD's uncompressed gradients, the blocks' reduce-scatters, on one machine
//   the replicated gradients); not hidden: what crosses machines after unscaling (the
//   hierarchy's replicated gradients, the shards' averages, PowerSGD's P and Q).
#include <cstdint>
#include <string>
#include <vector>

#include "dalle/train/trainers/prior_trainer.h"

namespace dalle::train {

// The machines a plan is for. Link speeds are each direction, in Gbit/s.
struct ClusterShape {
  int64_t nodes = 1;
  int64_t gpus_per_node = 8;
  double gpu_memory_gib = 80;
  double peak_tflops = 989;        // dense 16-bit, per GPU (H100 SXM bf16)
  double mfu = 0.4;                // model FLOPs utilisation assumed for compute
  double link_within_gbps = 3600;  // per GPU to the others of its machine (NVLink 4: 450 GB/s)
  double link_across_gbps = 3200;  // per machine to the others (8 x 400 Gbit/s InfiniBand)

  int64_t ranks() const { return nodes * gpus_per_node; }
  // Throws Error naming the first field out of range.
  void validate() const;
};

// When a part of a rank's memory is held.
enum class MemoryPhase { kept, backward, reduction };

struct MemoryPart {
  std::string name;
  MemoryPhase phase;
  double bytes;
  std::string rule;  // how it was counted, for the table
};

// Where a collective's ranks are: one machine; one rank per machine (a group per local
// rank, all at once); every rank of every machine.
enum class CollectiveScope { within, across, spanning };

struct TrafficPart {
  std::string name;
  std::string collective;  // all-reduce, all-gather or reduce-scatter
  CollectiveScope scope;
  int64_t ranks;           // in each group
  double payload_bytes;    // per rank per update
  std::string counted_by;  // the counter that counts it, empty when none does
  double seconds;          // on the wire, by the ring model
  bool hidden;             // may overlap computation
};

struct ParameterCounts {
  int64_t total = 0, in_resblocks = 0, outside_resblocks = 0, matrix_weights = 0;
  int64_t per_rank = 0;  // what a rank holds and steps: its shards (padding included) and the rest
  // Fine-tuning (optimizer.trainable, adapter): the adapters' values (in `total` too) and the
  // values that train; `trained` is `total` when nothing is frozen.
  int64_t adapters = 0, trained = 0;
};

struct CapacityPlan {
  ClusterShape cluster;
  models::PriorConfig model;
  std::string precision, adam_moments, sharding, gradient_reduction;
  bool sharded = false;     // within_node with more than one GPU per machine
  std::string checkpointing;  // in words
  int64_t global_batch = 0, batch_per_rank = 0, tokens_per_rank = 0;
  ParameterCounts parameters;

  std::vector<MemoryPart> memory;
  double kept_bytes = 0, backward_bytes = 0, reduction_bytes = 0, peak_bytes = 0, capacity_bytes = 0;
  bool fits = false;
  std::vector<std::string> too_large;  // the fewest largest parts without which the rest would fit
  double startup_bytes = 0;            // the whole model and its validation copy, before sharding
  bool fits_at_startup = false;

  std::vector<TrafficPart> traffic;
  double bytes_within = 0, bytes_across = 0;
  double bytes_across_uncompressed = 0;  // what crosses machines without PowerSGD (and before start_update)

  double flops_per_token = 0, flops_per_update = 0;
  double compute_seconds = 0, exposed_communication_seconds = 0, step_seconds = 0, tokens_per_second = 0;
  std::vector<std::string> notes;
};

// The plan of training `recipe` on `cluster`. Throws Error on a cluster out of range or a
// batch that does not divide between the ranks.
CapacityPlan plan_capacity(const PriorTrainConfig& recipe, const ClusterShape& cluster);

// The plan as a JSON document (bytes, seconds and FLOPs as numbers) ...
std::string capacity_plan_json(const CapacityPlan& plan);
// ... and as a table for a terminal.
std::string capacity_plan_table(const CapacityPlan& plan);

const char* phase_name(MemoryPhase phase);
const char* scope_name(CollectiveScope scope);

}  // namespace dalle::train
