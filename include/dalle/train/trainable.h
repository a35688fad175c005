#pragma once
// Freezing part of a model for fine-tuning (optimizer.trainable): the parameters whose names
// match none of the patterns stop requiring gradients, so that backward computes none for
// them, the optimizer keeps no moments for them and the reducer never sends them.
#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "dalle/models/adapter.h"

namespace dalle::train {

// Freezes the parameters of `model` that match none of `patterns` (fnmatch globs, `*`
// crossing dots); nothing when `patterns` is empty. Returns how many parameters train.
// Throws naming `what` for a pattern that matches no parameter, or patterns that leave none.
int64_t freeze_all_but(torch::nn::Module& model, const std::vector<std::string>& patterns, const std::string& what);
// The same for a part of a model built alone (a resblock, cut into shards before the next is
// built), its parameters named `prefix` + their name in `part`: a pattern may match nothing
// there (freeze_all_but on the whole model checks the patterns).
void freeze_part_all_but(torch::nn::Module& part, const std::vector<std::string>& patterns, const std::string& prefix);

// What trains in a recipe: optimizer.trainable's patterns, and the adapters' tensors when
// `adapter` adds adapters (empty, with no adapters: everything trains).
std::vector<std::string> trainable_patterns(std::vector<std::string> trainable, const models::AdapterConfig& adapter);

// Keeps the frozen matrices (two or more dimensions) of `model` whose names start with
// `prefix` in `storage` (16 bits: their consumers must run under autocast, which casts them
// anyway); returns their names.
std::vector<std::string> store_frozen_matrices(torch::nn::Module& model, const std::string& prefix,
                                               torch::ScalarType storage);

// The tensors of `parameters` that require gradients, in order.
std::vector<torch::Tensor> trained_only(const std::vector<torch::Tensor>& parameters);

}  // namespace dalle::train
