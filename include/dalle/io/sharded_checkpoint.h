#pragma once
// A checkpoint that the ranks of a job write together (a model whose parameters are sharded
// between them). Rank 0 writes the checkpoint's own files, with the shard layout in its state
// metadata; every rank writes its shard (flat tensors "<kind>.<group>", this rank's part of
// each group's values, in the layout's order). load_checkpoint (io/checkpoint.h) joins the
// shards and puts each kind's values where the layout says, under their parameters' names.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dalle/io/checkpoint.h"
#include "dalle/io/safetensors_writer.h"

namespace dalle::io {

// The values each of `ranks` ranks holds of a group of `values` cut into equal shards: values
// / ranks rounded up, the last shard zero-padded at its end; how distributed::ShardedParameters
// cuts its groups, the shard files hold them and the capacity plan counts them.
constexpr int64_t shard_size(int64_t values, int64_t ranks) { return (values + ranks - 1) / ranks; }

struct ShardLayout {
  struct Parameter {
    std::string name;
    std::vector<int64_t> shape;
  };
  struct Kind {
    bool into_weights = false;  // else into the state
    std::string prefix = {}, suffix = {};  // of the names there ("ema." + name, "adamw." + name + ".exp_avg")
  };
  int64_t ranks = 1;
  std::vector<std::vector<Parameter>> groups = {};
  std::map<std::string, Kind> kinds = {};
};

// A sharded checkpoint's inference weights (its moving average where it keeps one, else its
// weights) left in its shard files, mapped and unread: each group is joined from the shards
// when one of its parameters is read, and its pages released, so that a reader that takes one
// block at a time holds one block at a time (a sharded trainer's init_from). A fine-tuning
// run's may rest on its base's: what the run does not hold is read from the base's shards.
class ShardedWeights {
 public:
  ShardedWeights() = default;
  ShardedWeights(std::string directory, ShardLayout layout);
  bool empty() const { return !files_ && !base_; }
  std::vector<std::string> names() const;
  // Each parameter's name, shape and stored dtype, in the layout's order (the base's after).
  std::vector<TensorSpec> specs() const;
  // True when the checkpoint's own shards are its moving average (else its weights, or none).
  bool moving_average() const { return files_ && kind_ == "ema"; }
  // The whole values of the parameters `wanted` picks by name (views of their groups, joined).
  TensorMap read(const std::function<bool(const std::string&)>& wanted) const;
  // `base`'s weights beneath these: read where neither these nor `held` (what the checkpoint
  // holds whole) name them.
  void rest_on(ShardedWeights base, const std::vector<std::string>& held);

 private:
  // The base's parameters read: those these and `held` do not name.
  bool from_base(const std::string& name) const;

  std::string directory_;
  ShardLayout layout_;
  std::string kind_;
  std::shared_ptr<const std::vector<Safetensors>> files_;
  std::shared_ptr<const ShardedWeights> base_;
  std::set<std::string> shadowed_;  // of the base's parameters, those not read from it
};

// A checkpoint as one rank of a sharded job needs it, reading only what that rank will hold:
// rank 0's files (the replicated parameters and the state; in a checkpoint that was not
// sharded, every parameter, mapped and left unread until used) and, of each group of
// `wanted` (the job's resblock groups and the kinds it restores), the slice of the group's
// flat values that rank `rank` of `ranks` holds (shard_size(values, ranks), zero-padded at
// the end, as distributed::ShardedParameters cuts them). In a sharded checkpoint the slices
// are read from the shard files that hold them, on any world size; in another, from the
// whole tensors; so are groups beyond those its shards hold (a checkpoint written when fewer
// parameters were sharded). A kind the checkpoint lacks (moments before the first update)
// has no slices.
// The replicated part has its base's weights filled in, as load_checkpoint fills them, but for
// a sharded base's shards, left unread.
struct RankCheckpoint {
  Checkpoint replicated;  // the shard layout's own parameters absent
  ShardedWeights unread_base;  // a sharded base's parameters, joined when read (the frozen blocks)
  TensorMap slices;       // "<kind>.<group>"
  // The bytes of values read from each shard file, by the rank that wrote it.
  std::map<int64_t, int64_t> shard_bytes_read;
  // The other entries of this rank's own shard file (what is cut by the ranks' blocks of
  // rows, such as PowerSGD's Q), when the checkpoint was written by `ranks` ranks.
  TensorMap own;
};
// What takes one group's slices as they are read ("<kind>.<group>"; what it leaves in `slices`
// is freed), with the replicated part read so far.
using TakeGroup = std::function<void(size_t group, TensorMap& slices, const Checkpoint& replicated)>;
// With `take`, each group's slices go to it as soon as they are read, never into `slices`:
// a rank then holds one group's slices at a time, not its whole state twice.
RankCheckpoint load_checkpoint_for_rank(const std::string& directory, const ShardLayout& wanted, int64_t rank,
                                        int64_t ranks, const TakeGroup& take = nullptr);

// load_inference_checkpoint (io/checkpoint.h), but a sharded checkpoint keeps its shards'
// parameters in `unread`, absent from its weights, and so does a sharded base of it (a
// fine-tuning run's frozen blocks); else `unread` is empty.
Checkpoint load_inference_checkpoint(const std::string& directory, ShardedWeights& unread);

// Rank 0's files of a sharded checkpoint into `staging`, the layout in its state metadata;
// `streamed`: weights after the checkpoint's own, declared by their specs and handed to the
// writer by `write` as they are made (frozen blocks gathered one group at a time).
void write_checkpoint_files(const std::string& staging, Checkpoint checkpoint, const ShardLayout& layout,
                            const std::vector<TensorSpec>& streamed = {},
                            const std::function<void(SafetensorsWriter&)>& write = nullptr);
// Rank `rank`'s shard into `staging`.
void write_checkpoint_shard(const std::string& staging, int64_t rank, int64_t ranks, const TensorMap& shard);

}  // namespace dalle::io
