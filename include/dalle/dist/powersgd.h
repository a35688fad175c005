#pragma once
// PowerSGD gradient reduction (Vogels et al. 2019; DALL-E's scheme, paper-facts.md): each
// gradient matrix M (n x m, with this replica's error feedback added) is averaged as a
// rank-r product P Q^T instead of whole. P = M Q is averaged and orthogonalized (Householder
// QR after adding 1e-6 I), Q = M^T P is averaged, and the replica keeps M - P Q^T as its
// error for the next update. Q starts as a seeded Gaussian, the same on every replica, and
// stays fixed (DALL-E) or starts the next power iteration (warm start, PyTorch's hook).
// Vectors, and matrices too small to gain, go uncompressed in one bucketed fp32 all-reduce;
// before `start_update` every gradient does.
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "dalle/dist/data_parallel.h"
#include "dalle/dist/gradient_reducer.h"
#include "dalle/dist/process_group.h"

namespace dalle::dist {

struct PowerSgdOptions {
  int64_t rank = 4;                   // r of P (n x r) and Q (m x r)
  int64_t start_update = 1000;        // updates before this one are averaged whole
  double min_compression_rate = 2.0;  // compress a matrix only when n m > rate (n + m) r
  bool warm_start = false;            // false: Q fixed (DALL-E); true: the last Q is the next start
  uint64_t seed = 0;                  // of the first Q
  int64_t bucket_bytes = 25 << 20;    // of the uncompressed all-reduce
};

class PowerSgdReducer final : public GradientReducer {
 public:
  PowerSgdReducer(std::shared_ptr<ProcessGroup> group, PowerSgdOptions options);

  void reduce(const std::vector<torch::Tensor>& parameters) override;
  torch::Tensor agree(const torch::Tensor& flags) override { return whole_.agree(flags); }
  int64_t replicas() const override { return whole_.replicas(); }

  // The error feedback, as its mean over the replicas (what enters the next averages: a
  // resume with it takes the same updates), Q, and the update count.
  void save_state(io::TensorMap& state, const std::string& prefix) override;
  void load_state(const io::TensorMap& state, const std::string& prefix) override;

  // Whether a gradient of `shape` is compressed (at the options' rank and floor).
  static bool compresses(const std::vector<int64_t>& shape, const PowerSgdOptions& options);
  // The values a replica sends for a gradient of `shape`: (n + m) r compressed, else all.
  static int64_t values_sent(const std::vector<int64_t>& shape, const PowerSgdOptions& options);
  // The payload this replica handed to all-reduce so far: P and Q, and the whole gradients.
  int64_t bytes_reduced() const { return bytes_compressed_ + whole_.bytes_reduced(); }

 private:
  // A compressed matrix's Q and this replica's error feedback.
  struct Matrix {
    torch::Tensor q, error;
  };
  void compress(const std::vector<torch::Tensor>& gradients);
  Matrix& state_of(const torch::Tensor& parameter, int64_t n, int64_t m);

  std::shared_ptr<ProcessGroup> group_;
  PowerSgdOptions options_;
  DataParallelReducer whole_;
  std::map<const torch::TensorImpl*, Matrix> matrices_;
  std::vector<const torch::TensorImpl*> order_;  // of the matrices' first updates
  std::map<size_t, Matrix> restored_;            // from a checkpoint, until the matrix comes
  int64_t updates_ = 0, bytes_compressed_ = 0;
};

}  // namespace dalle::dist
