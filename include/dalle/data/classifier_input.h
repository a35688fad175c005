#pragma once
// How an item is framed for the item classifier (models/item_classifier.h): the same way for
// Fashion-MNIST's training items and for items cut out of generated images.
#include <torch/types.h>

#include <cstdint>

namespace dalle::data {

// The side of the classifier's input (models::kClassifierInputSize; a test holds them together).
inline constexpr int64_t kClassifierInputSize = 28;

// An item as the classifier sees it: from a grey [H, W] picture of one item on black, the
// box of the pixels above `threshold` x its brightest, made square about its centre,
// resized to 28x28 and scaled so that the brightest pixel is 1. Fashion-MNIST items, whose
// longer side already spans the frame, come out nearly as they are. An all-black picture
// gives zeros. Returns [1, 28, 28] float.
torch::Tensor classifier_input(const torch::Tensor& grey, double threshold = 0.1);

}  // namespace dalle::data
