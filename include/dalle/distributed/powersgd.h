#pragma once
// PowerSGD gradient reduction (Vogels et al. 2019; DALL-E's scheme, paper-facts.md): each
// gradient matrix M (n x m) is averaged as a rank-r product P Q^T instead of whole. The
// gradient is accumulated straight into the matrix's error buffer, which then holds M (this
// replica's gradient plus what earlier updates dropped); P = M Q is averaged and
// orthogonalized (Householder QR after adding 1e-6 I), Q = M^T P is averaged, and the buffer
// keeps M - P Q^T. Q starts as a seeded Gaussian, the same on every replica, and stays fixed
// (DALL-E) or starts the next power iteration (warm start, PyTorch's hook). P, Q and the
// buffers may be 16-bit, infinities clamped; a buffer is zeroed only when it holds
// non-finite values. Vectors, and matrices too small to gain, go uncompressed in one
// bucketed fp32 all-reduce; before `start_update` every gradient does.
//
// Two users: PowerSgdReducer, the flat reducer of data parallelism (every rank compresses
// its whole gradients with every other rank), and ShardedReducer (distributed/sharded_reducer.h),
// DALL-E's hierarchy, which compresses each rank's shard across the machines.
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "dalle/distributed/data_parallel.h"
#include "dalle/distributed/gradient_reducer.h"
#include "dalle/distributed/process_group.h"

namespace dalle::distributed {

struct PowerSgdOptions {
  int64_t rank = 4;                   // r of P (n x r) and Q (m x r)
  int64_t start_update = 1000;        // updates before this one are averaged whole
  double min_compression_rate = 2.0;  // compress a matrix only when n m > rate (n + m) r
  bool warm_start = false;            // false: Q fixed (DALL-E); true: the last Q is the next start
  // Of P and Q on the wire and of the error buffers: kFloat32, or 16 bits (DALL-E) as kBFloat16
  // (fp32's range) or kHalf (infinities clamped to +-65504).
  torch::ScalarType dtype = torch::kFloat32;
  uint64_t seed = 0;                  // of the first Q
  int64_t bucket_bytes = 25 << 20;    // of the uncompressed all-reduce
};

// Whether an n x m gradient matrix is compressed at the options' rank and floor...
bool compresses(int64_t rows, int64_t columns, const PowerSgdOptions& options);
// ... and a gradient of `shape` (its first dimension by the rest; vectors never).
bool compresses(const std::vector<int64_t>& shape, const PowerSgdOptions& options);
// The rank an n x m matrix is compressed at: r, or less for a matrix narrower than r.
int64_t effective_rank(int64_t rows, int64_t columns, const PowerSgdOptions& options);
// The values a replica sends for a gradient of `shape`: (n + m) r compressed, else all.
int64_t values_sent(const std::vector<int64_t>& shape, const PowerSgdOptions& options);

// What PowerSGD keeps for one matrix: Q (m x r, in q_dtype) and the error buffer (n x m, in
// the options' dtype; it may be a view into a larger buffer, and is only changed in place).
struct LowRankState {
  torch::Tensor q, error;
};

// Q's storage: the options' dtype when Q stays fixed (DALL-E: a random subspace, which 16 bits
// span as well, at half the bytes), float32 when warm-started (it carries the power iteration
// from update to update).
torch::ScalarType q_dtype(const PowerSgdOptions& options);

// The first Q (m x r, in q_dtype) of an n x m matrix numbered `slot`: a Gaussian seeded by the
// options and the slot, the same on every replica.
torch::Tensor initial_q(const PowerSgdOptions& options, int64_t slot, int64_t rows, int64_t columns,
                        torch::Device device);

// A matrix's average over the group as P Q^T: P (n x r) orthonormal, in float32; Q (m x r)
// as it crossed the wire.
struct LowRankAverage {
  torch::Tensor p, q;
  // P Q^T, n x m, in float32.
  torch::Tensor decompressed() const;
};

// The low-rank averaging of a set of gradient matrices over one group of replicas.
class LowRankAverager {
 public:
  LowRankAverager(std::shared_ptr<ProcessGroup> group, const PowerSgdOptions& options);

  // Each `gradients[i]` (an n x m view of a gradient, replaced in place by the average) is
  // accumulated into `states[i]`'s error buffer and averaged over the group as P Q^T; the
  // buffer keeps what the average dropped. Returns the averages' squared Frobenius norm,
  // read from Q (P is orthonormal), as DALL-E measured its global norm.
  double average(const std::vector<torch::Tensor>& gradients, const std::vector<LowRankState*>& states);
  // The part of average() that leaves the buffers alone: each `states[i]`'s error buffer
  // already holds M (the gradient accumulated into it); returns M's averages, their squared
  // norm added to `square`. The caller decompresses each when it needs it and keeps
  // M - P Q^T in the buffer (drop_from_error), one matrix at a time.
  std::vector<LowRankAverage> compress(const std::vector<LowRankState*>& states, double& square);
  // The buffer keeps what `average` (of its M) dropped: M - `decompressed`.
  void drop_from_error(LowRankState& state, const torch::Tensor& decompressed) const;
  // P's and Q's bytes handed to all-reduce so far.
  int64_t bytes_reduced() const { return bytes_; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  PowerSgdOptions options_;
  int64_t bytes_ = 0;
};

// Flat PowerSGD for data parallelism over one group.
class PowerSgdReducer final : public GradientReducer {
 public:
  // `overlap`: the gradients never compressed are averaged in buckets during backward.
  PowerSgdReducer(std::shared_ptr<ProcessGroup> group, PowerSgdOptions options, bool overlap = true);

  // The gradients never compressed (vectors, small matrices) are averaged whole before
  // unscaling, in data parallelism's buckets (overlapped with backward when attached); the
  // compressible matrices after it, compressed from start_update, whole before (neither
  // overlapped: the power iteration needs the whole gradient and its true scale).
  void reduce_scaled(const std::vector<torch::Tensor>& parameters) override;
  void reduce_unscaled(const std::vector<torch::Tensor>& parameters) override;
  void before_backward(const std::vector<torch::Tensor>& parameters) override;
  torch::Tensor agree(const torch::Tensor& flags) override { return whole_.agree(flags); }
  int64_t replicas() const override { return whole_.replicas(); }
  // From Q and the uncompressed gradients, after a compressed reduction.
  double gradient_norm(const std::vector<torch::Tensor>& parameters) override;
  int64_t bytes_across_machines() const override { return bytes_reduced(); }

  // The error feedback, as its mean over the replicas (what enters the next averages: a
  // resume with it takes the same updates), Q, and the update count.
  void save_state(io::TensorMap& state, const std::string& prefix) override;
  void load_state(const io::TensorMap& state, const std::string& prefix) override;

  // The payload this replica handed to all-reduce so far: P and Q, and the whole gradients.
  int64_t bytes_reduced() const { return low_rank_.bytes_reduced() + whole_.bytes_reduced(); }

 private:
  LowRankState& state_of(const torch::Tensor& parameter, int64_t n, int64_t m);
  std::vector<torch::Tensor> never_compressed(const std::vector<torch::Tensor>& parameters) const;

  std::shared_ptr<ProcessGroup> group_;
  PowerSgdOptions options_;
  DataParallelReducer whole_;
  LowRankAverager low_rank_;
  std::map<const torch::TensorImpl*, LowRankState> matrices_;
  std::vector<const torch::TensorImpl*> order_;  // of the matrices' first updates
  std::map<size_t, LowRankState> restored_;      // from a checkpoint, until the matrix comes
  std::vector<torch::Tensor> compressed_;        // at the last update
  double compressed_square_ = 0;                 // their squared norm, from Q
  const torch::TensorImpl* first_parameter_ = nullptr;  // of the first reduction: it counts the updates
  int64_t updates_ = 0;
};

}  // namespace dalle::distributed
