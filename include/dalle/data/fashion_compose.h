#pragma once
// fashion-compose, the project's demo and benchmark set: Fashion-MNIST items recoloured in
// one of 8 named colours and placed one or two to a canvas at named positions, captioned
// "a red sneaker on the left and a blue bag on the right". A fixed list of (colour, item)
// combinations never appears in training: the `heldout` split holds them, to test
// zero-shot composition. Each image's true items, colours, positions and boxes are saved
// with its caption.
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/data/fashion_mnist.h"

namespace dalle::data {

struct NamedColour {
  std::string name;
  std::array<float, 3> rgb;
};
const std::vector<NamedColour>& fashion_compose_colours();
// "left", "right", "top", "bottom", "center".
const std::vector<std::string>& fashion_compose_positions();
// The centre of a named position as fractions of the canvas: {x, y}, e.g. left {0.25, 0.5}.
std::array<double, 2> fashion_compose_position_centre(const std::string& position);

// The caption grammar, shared by the composer that writes captions and the parser that
// reads them back, so that the two cannot drift apart. One object's phrase: "a red sneaker
// on the left", "an orange coat at the top", "a white bag in the center".
std::string fashion_compose_phrase(const std::string& colour, const std::string& item, const std::string& position);
// Phrases joined by " and ".
std::string fashion_compose_caption(const std::vector<std::string>& phrases);

// One object as a caption names it.
struct CaptionObject {
  std::string colour;
  std::string item;
  int64_t label = 0;  // the item's Fashion-MNIST class
  std::string position;
};
// The objects of a caption the composer could have written, in caption order. Case, runs of
// spaces and a final full stop are forgiven; anything else outside the grammar (an unknown
// colour, item or position, another wording) gives nullopt.
std::optional<std::vector<CaptionObject>> parse_fashion_compose_caption(const std::string& caption);

struct FashionComposeConfig {
  int64_t canvas_size = 64;
  int64_t item_size = 28;
  int64_t train_images = 20000;
  int64_t test_images = 1000;
  int64_t heldout_images = 1000;
  double two_item_fraction = 0.5;
  int64_t jitter = 2;
  int64_t seed = 0;
  std::vector<std::string> heldout = {"red sneaker",   "blue bag",      "green dress",
                                      "yellow trouser", "purple ankle boot", "orange coat",
                                      "cyan sandal",   "white shirt"};
  std::string source = kFashionMnistDir;

  void visit(ConfigVisitor& v) {
    v.field("canvas_size", canvas_size, "side of the square canvas in pixels", {.min = 32, .max = 1024});
    v.field("item_size", item_size, "side of an item on the canvas (Fashion-MNIST items are 28)",
            {.min = 8, .max = 512});
    v.field("train_images", train_images, "images in the train split (Fashion-MNIST train items)",
            {.min = 0, .max = 10000000});
    v.field("test_images", test_images,
            "images in the test split: seen combinations, Fashion-MNIST test items", {.min = 0, .max = 10000000});
    v.field("heldout_images", heldout_images,
            "images in the heldout split: each shows a held-out combination", {.min = 0, .max = 10000000});
    v.field("two_item_fraction", two_item_fraction, "fraction of images with two items",
            {.min = 0.0, .max = 1.0});
    v.field("jitter", jitter, "largest random shift of an item from its position's centre, in pixels",
            {.min = 0, .max = 64});
    v.field("seed", seed, "random seed: the same seed builds the same dataset", {.min = 0});
    v.field("heldout", heldout, "'<colour> <item>' combinations kept out of training");
    v.field("source", source, "folder of the Fashion-MNIST idx files");
  }
};

struct ComposedObject {
  std::string item;
  int64_t label = 0;
  std::string colour;
  std::string position;
  std::array<int64_t, 4> box{};  // x0, y0, x1, y1 of the item's visible pixels, x1/y1 exclusive
  int64_t source_index = 0;       // index in the Fashion-MNIST split it came from
};

struct ComposedImage {
  torch::Tensor image;  // [3, canvas, canvas] in [0, 1]
  std::string caption;
  std::vector<ComposedObject> objects;
};

enum class ComposeSplit { train, test, heldout };

class FashionComposer {
 public:
  // `items` is the Fashion-MNIST split items are drawn from.
  FashionComposer(FashionComposeConfig config, FashionMnist items);
  ComposedImage compose(ComposeSplit split, std::mt19937_64& rng) const;
  bool is_heldout(const std::string& colour, int64_t label) const;

 private:
  struct Combination {
    size_t colour;
    int64_t label;
  };
  Combination draw(const std::vector<Combination>& from, std::mt19937_64& rng) const;
  ComposedObject place(const Combination& combination, const std::string& position,
                       torch::Tensor& canvas, std::mt19937_64& rng) const;

  FashionComposeConfig config_;
  FashionMnist items_;
  std::array<std::vector<int64_t>, 10> items_by_label_;
  std::vector<Combination> seen_, heldout_, all_;
};

// Builds <out>/{train,test,heldout}/ (images/ + captions.jsonl with the ground truth),
// <out>/config.yaml and <out>/sample_grid.png.
void build_fashion_compose(const FashionComposeConfig& config, const std::string& out);

}  // namespace dalle::data
