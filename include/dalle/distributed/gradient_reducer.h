#pragma once
// How the gradients of data-parallel replicas become one: the seam between an update step
// (train/update_step.h) and the processes that train one model together. The update step
// names the parameters it steps before each backward (`before_backward`), so that a reducer
// may start averaging a bucket of gradients while backward still computes the rest; after
// backward it calls
// `reduce_scaled`, which finishes that part, then `agree` on its finite flags, so that every
// replica skips, and backs off its fp16 scales, at the same updates, and, when it does not
// skip, `reduce_unscaled` on the unscaled gradients for what must see true gradients
// (PowerSGD's error feedback would otherwise carry one update's fp16 scale into the next).
// The trainers never see which reducer they run with, as Flashlight's modules never see its
// Reducer.
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dalle/io/safetensors.h"

namespace dalle::distributed {

class GradientReducer {
 public:
  virtual ~GradientReducer() = default;

  // Replaces the defined gradient of every tensor of `parameters` by the replicas' mean (or,
  // for sharded parameters, by the mean of this replica's shard), in place: the two parts below.
  void reduce(const std::vector<torch::Tensor>& parameters) {
    reduce_scaled(parameters);
    reduce_unscaled(parameters);
  }
  // The part of the reduction that may see the gradients as backward left them (scaled by
  // fp16's factors, which averaging commutes with): for the attached parameters, what was
  // started during backward is waited for here.
  virtual void reduce_scaled(const std::vector<torch::Tensor>& parameters) = 0;
  // The part that must see the true gradients; called only for an update that is not skipped.
  virtual void reduce_unscaled(const std::vector<torch::Tensor>&) {}
  // An update step is about to backpropagate into `parameters` (the list it then passes to
  // reduce_scaled): a reducer that overlaps communication with backward hooks their
  // gradients (the first time) and listens to them, and only them, until reduce_scaled.
  virtual void before_backward(const std::vector<torch::Tensor>&) {}
  // `flags`: [G] booleans of this replica, one per fp16 scale group, true where its
  // gradients are finite. Returns the flags every replica agrees on: true where all are.
  virtual torch::Tensor agree(const torch::Tensor& flags) = 0;
  // The data-parallel replicas M, which multiply DALL-E's fp16 gradient scales.
  virtual int64_t replicas() const = 0;
  // The 2-norm of the gradients of `parameters` (as torch's clip_grad_norm_ measures it),
  // over the whole model: a reducer that leaves each replica a shard adds the others' parts.
  virtual double gradient_norm(const std::vector<torch::Tensor>& parameters);
  // The payload this rank has handed to collectives whose ranks are on more than one
  // machine, so far (what crosses the network between machines, in a job on several): a
  // reducer over every rank counts all it reduces.
  virtual int64_t bytes_across_machines() const { return 0; }
  // A reducer may keep some gradients compressed after reduce_unscaled (PowerSGD's P and Q,
  // across machines), those parameters' .grad() then undefined, so that no rank ever holds
  // every decompressed gradient at once (DALL-E): the optimizer asks for each as it steps
  // it. `keeps_gradients` says whether any is kept; `take_gradient` gives one, in float32,
  // times `factor` (clipping), once, and an undefined tensor for a parameter it keeps none of.
  virtual bool keeps_gradients() const { return false; }
  virtual torch::Tensor take_gradient(const torch::Tensor&, double) { return {}; }
  // What the reducer carries from one update to the next (PowerSGD's error feedback), into
  // or out of a checkpoint's state under `prefix`. Every rank calls both, at the same point.
  virtual void save_state(io::TensorMap&, const std::string&) {}
  virtual void load_state(const io::TensorMap&, const std::string&) {}
};

// One process: its gradients and flags are already every replica's.
class LocalReducer final : public GradientReducer {
 public:
  void reduce_scaled(const std::vector<torch::Tensor>&) override {}
  torch::Tensor agree(const torch::Tensor& flags) override { return flags; }
  int64_t replicas() const override { return 1; }
};

}  // namespace dalle::distributed
