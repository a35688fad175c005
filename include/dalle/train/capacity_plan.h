#pragma once
// A capacity plan for training the prior (dalle-plan): from a dalle-train recipe and a
// cluster's shape, what each rank holds in memory, what it hands to collectives per update,
// the model FLOPs per update, a predicted step time, and whether it fits. What it counts
// exactly, what it estimates and by which rules: docs/distributed.md, "The planner's rules".
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

// When a part of a rank's memory is held: on the GPU between updates; during backward: all of
// it or, sharded, only while the head backpropagates or only while a block does (the larger
// of those two counts beside all of it), or only as the embeddings end it (the blocks' inputs
// freed: counted alone); during the gradient reduction; or between updates in host memory,
// outside the GPU's peak.
enum class MemoryPhase { kept, backward, backward_head, backward_blocks, backward_embeddings, reduction, host };

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
  int64_t per_rank = 0;  // what a rank holds: sharded, its shards (padding included) and the adapters
  // Fine-tuning (optimizer.trainable, adapter): the adapters' values (in `total` too) and the
  // values that train; `trained` is `total` when nothing is frozen.
  int64_t adapters = 0, trained = 0;
};

struct CapacityPlan {
  ClusterShape cluster;
  models::PriorConfig model;
  std::string precision, adam_moments, sharding, gradient_reduction;
  bool sharded = false;     // within_node with more than one GPU per machine
  // The storage of the sharded resblocks' trained matrices and their gradients
  // (precision.weights: 16 bits only when sharded; plan_capacity refuses it otherwise).
  std::string weights = "float32";
  std::string checkpointing;  // in words
  int64_t global_batch = 0, batch_per_rank = 0, tokens_per_rank = 0;
  ParameterCounts parameters;

  std::vector<MemoryPart> memory;
  // backward_bytes: the most backward holds at once (MemoryPhase).
  double kept_bytes = 0, backward_bytes = 0, reduction_bytes = 0, peak_bytes = 0, capacity_bytes = 0;
  double host_bytes = 0;  // kept in host memory (16-bit matrix shards' moving average): not in the peak
  bool fits = false;
  std::vector<std::string> too_large;  // the fewest largest parts without which the rest would fit
  // At start: built sharded (a sharded run that trains everything from a random start), the
  // weights' shards, the embeddings and head whole (cut last) and one block whole twice
  // (drawn, and flattened to be cut); else the whole fp32 model, and unsharded its
  // validation copy (a sharded run keeps none).
  bool built_sharded = false;
  double startup_bytes = 0;
  bool fits_at_startup = false;

  std::vector<TrafficPart> traffic;
  double bytes_within = 0, bytes_across = 0;
  double bytes_across_uncompressed = 0;  // what crosses machines without PowerSGD (and before start_update)

  double flops_per_token = 0, flops_per_update = 0;
  double compute_seconds = 0, exposed_communication_seconds = 0, step_seconds = 0, tokens_per_second = 0;
  std::vector<std::string> notes;
};

// The plan of training `recipe` on `cluster`. Throws Error on a cluster out of range, a
// batch that does not divide between the ranks, or a 16-bit storage the trainer refuses
// (frozen_weights or precision.weights in a float32 run, precision.weights not sharded).
CapacityPlan plan_capacity(const PriorTrainConfig& recipe, const ClusterShape& cluster);

// The plan as a JSON document (bytes, seconds and FLOPs as numbers) ...
std::string capacity_plan_json(const CapacityPlan& plan);
// ... and as a table for a terminal.
std::string capacity_plan_table(const CapacityPlan& plan);

const char* phase_name(MemoryPhase phase);
const char* scope_name(CollectiveScope scope);

}  // namespace dalle::train
