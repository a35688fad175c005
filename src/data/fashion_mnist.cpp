#include "dalle/data/fashion_mnist.h"

#include <cstdio>
#include <filesystem>
#include <sstream>
#include <torch/torch.h>

#include "dalle/data/image.h"
#include "dalle/error.h"
#include "dalle/io/atomic_file.h"
#include "dalle/log.h"
#include "../io/gzip_file.h"

namespace dalle::data {
namespace fs = std::filesystem;

const std::array<std::string, 10>& fashion_mnist_classes() {
  static const std::array<std::string, 10> names = {
      "t-shirt", "trouser", "pullover", "dress", "coat",
      "sandal",  "shirt",   "sneaker",  "bag",   "ankle boot"};
  return names;
}

std::string with_article(const std::string& phrase) {
  const bool vowel = !phrase.empty() && std::string("aeiou").find(phrase[0]) != std::string::npos;
  return (vowel ? "an " : "a ") + phrase;
}

namespace {

uint32_t big_endian(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

}  // namespace

torch::Tensor read_idx(const std::string& path) {
  const auto bytes = io::read_maybe_gzipped(path);
  if (bytes.size() < 4 || bytes[0] != 0 || bytes[1] != 0 || bytes[2] != 0x08) {
    throw Error(path + ": not an idx file of unsigned bytes (bad magic number)");
  }
  const int dims = bytes[3];
  if (dims < 1 || dims > 4 || bytes.size() < 4 + 4 * static_cast<size_t>(dims)) {
    throw Error(path + ": idx header is truncated or names " + std::to_string(dims) + " dimensions");
  }
  std::vector<int64_t> shape;
  size_t count = 1;
  for (int d = 0; d < dims; ++d) {
    shape.push_back(big_endian(&bytes[4 + 4 * d]));
    count *= static_cast<size_t>(shape.back());
  }
  const size_t offset = 4 + 4 * static_cast<size_t>(dims);
  if (bytes.size() - offset != count) {
    throw Error(path + ": idx data holds " + std::to_string(bytes.size() - offset) +
                " bytes, its header promises " + std::to_string(count));
  }
  auto tensor = torch::empty(shape, torch::kUInt8);
  std::memcpy(tensor.data_ptr(), bytes.data() + offset, count);
  return tensor;
}

FashionMnist load_fashion_mnist(const std::string& split, const std::string& directory) {
  if (split != "train" && split != "test") {
    throw Error("unknown Fashion-MNIST split '" + split + "' (expected train or test)");
  }
  const std::string prefix = split == "train" ? "train" : "t10k";
  auto find = [&](const std::string& stem) {
    for (const std::string& name : {stem + ".gz", stem}) {
      if (fs::exists(fs::path(directory) / name)) return (fs::path(directory) / name).string();
    }
    throw Error(directory + ": no " + stem + "[.gz]; install Debian's dataset-fashion-mnist package");
  };
  FashionMnist data;
  data.images = read_idx(find(prefix + "-images-idx3-ubyte"));
  data.labels = read_idx(find(prefix + "-labels-idx1-ubyte")).to(torch::kInt64);
  if (data.images.dim() != 3 || data.labels.dim() != 1 || data.images.size(0) != data.labels.size(0)) {
    throw Error(directory + ": Fashion-MNIST images and labels do not match");
  }
  if (data.labels.numel() > 0 && data.labels.max().item<int64_t>() >= 10) {
    throw Error(directory + ": Fashion-MNIST labels outside [0, 10)");
  }
  return data;
}

int64_t import_fashion_mnist(const std::string& out, const FashionMnistImportOptions& options) {
  if (options.templates.empty()) throw Error("at least one caption template is needed");
  const auto data = load_fashion_mnist(options.split, options.source);
  int64_t count = data.images.size(0);
  if (options.limit > 0) count = std::min(count, options.limit);
  fs::create_directories(fs::path(out) / "images");

  std::ostringstream captions;
  log::Progress progress("importing Fashion-MNIST " + options.split, count);
  for (int64_t i = 0; i < count; ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "images/%06lld.png", static_cast<long long>(i));
    write_png((fs::path(out) / name).string(), data.images[i].unsqueeze(0).to(torch::kFloat32) / 255.0);
    const auto& item = fashion_mnist_classes()[static_cast<size_t>(data.labels[i].item<int64_t>())];
    for (const auto& pattern : options.templates) {
      const std::string caption = replace_all(pattern, "{a_item}", with_article(item));
      captions << name << '\t' << replace_all(caption, "{item}", item) << '\n';
    }
    progress.advance();
  }
  progress.finish();
  io::write_file_atomic((fs::path(out) / "captions.tsv").string(), captions.str());
  return count;
}

}  // namespace dalle::data
