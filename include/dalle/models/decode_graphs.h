#pragma once
// What makes a decoding step replayable as a CUDA graph, kept across sampling calls: the
// step's tensors at fixed addresses (KV caches, the last codes, the device-held position,
// the draws) and the graphs captured of it, one per key (the samplers' key: the number of
// cache slots a step attends to, rounded up to a bucket). On a CUDA device, with graphs
// enabled, a key's first step runs eagerly on a side stream and is then captured; later
// steps of that key replay it, one launch for the whole model. Elsewhere a step runs
// eagerly, the same kernels on the same tensors: the two ways draw the same tokens.
//
// A step may read and write only tensors made by `buffer` (or constants it captured), must
// keep its shapes and never synchronise with the host. The samplers of models/prior_sampling.h
// and models/bart_sampling.h take one; dalle's pipeline keeps one per prior.
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

namespace dalle::models {

// A zero-filled tensor the first time `name` is asked for with these sizes and options; the
// same tensor, holding what it was last given, after that.
using TensorMaker =
    std::function<torch::Tensor(const std::string& name, at::IntArrayRef sizes, const torch::TensorOptions& options)>;

class DecodeGraphs {
 public:
  // `enabled` false: steps always run eagerly (the tensors are still kept).
  explicit DecodeGraphs(bool enabled = true);
  ~DecodeGraphs();
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;

  // Whether steps on `device` are captured: a CUDA device, a build with CUDA, graphs enabled.
  bool captures_on(const torch::Device& device) const;
  // The constants a step bakes in (batch, filters, guidance...): a signature other than the
  // last drops the graphs, which captured the old ones.
  void expect(const std::string& signature);
  // The tensor kept for `name` (TensorMaker's contract); a new one drops the graphs.
  torch::Tensor buffer(const std::string& name, at::IntArrayRef sizes, const torch::TensorOptions& options);
  TensorMaker maker();
  // Runs `step` on `device`: eagerly, or from the graph of `key` (captured on first use).
  void run(int64_t key, const torch::Device& device, const std::function<void()>& step);
  // Graphs held now; the steps replayed since construction.
  int64_t graphs() const;
  int64_t replays() const { return replays_; }
  // The graphs and tensors given back (the memory of a KV cache, say); the next call makes them anew.
  void clear();

  // The cache slots a step needing `needed` of `capacity` attends to: `needed` on the CPU; on
  // a GPU rounded up to kBucket, so that a decode meets few shapes: few graphs, and few
  // attention kernel plans when eager (cuDNN plans one per new length, seconds each time).
  int64_t keys_for(int64_t needed, int64_t capacity, const torch::Device& device) const;
  static constexpr int64_t kBucket = 64;

 private:
  struct Graphs;
  void drop_graphs();

  bool enabled_;
  bool failed_ = false;  // a capture failed once: steps run eagerly from then on
  std::string signature_;
  std::map<std::string, torch::Tensor> buffers_;
  std::unique_ptr<Graphs> graphs_;
  int64_t replays_ = 0;
};

}  // namespace dalle::models
