#pragma once
// Fashion-MNIST from Debian's dataset-fashion-mnist package (its idx files, gzipped or not).
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace dalle::data {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// The ten classes, in label order, as captions name them.
const std::array<std::string, 10>& fashion_mnist_classes();

// "an ankle boot", "a bag": the indefinite article the phrase's first letter asks for.
std::string with_article(const std::string& phrase);

// Reads an idx file (gzipped or plain): uint8 tensor whose shape is the file's dimensions.
// The magic number, dimension count and size are validated.
torch::Tensor read_idx(const std::string& path);

struct FashionMnist {
  torch::Tensor images;  // [N, 28, 28] uint8, bright item on black
  torch::Tensor labels;  // [N] int64 in [0, 10)
};
// `split` is "train" (60,000 items) or "test" (10,000).
FashionMnist load_fashion_mnist(const std::string& split, const std::string& directory = kFashionMnistDir);

struct FashionMnistImportOptions {
  std::string split = "train";
  int64_t limit = 0;  // 0: every item
  // "{item}" becomes the class name, "{a_item}" the class name after "a" or "an".
  std::vector<std::string> templates = {"{a_item}", "a photo of {a_item}",
                                        "a black and white picture of {a_item}"};
  std::string source = kFashionMnistDir;
};
// Writes <out>/images/*.png and <out>/captions.tsv with one caption per template per image.
// Returns the number of images written.
int64_t import_fashion_mnist(const std::string& out, const FashionMnistImportOptions& options);

}  // namespace dalle::data
