#pragma once
// Measuring what a picture shows, the way fashion-compose draws it: coloured items on black.
// Items are found from the pixels (brightest channel above a threshold, fragments joined,
// touching items split, specks dropped); each gets the named colour nearest to its bright
// pixels' hue, the named position nearest to its box's centre, and a crop framed for the
// item classifier, which names the item.
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "dalle/models/item_classifier.h"

namespace dalle::eval {

struct MeasureOptions {
  int64_t canvas_size = 64;  // pictures are resized to the composer's canvas first
  int64_t item_size = 28;    // an item's side on that canvas
  double threshold = 0.1;    // a pixel is part of an item when its brightest channel is above this
  int64_t join_gap = 2;      // fragments this many pixels apart (or less) join into one component
  int64_t min_pixels = 12;   // smaller objects are specks of noise and are dropped
  double colour_fraction = 0.5;  // the pixels at least this fraction of an item's brightest give its colour
};

struct MeasuredObject {
  std::string colour;                // nearest named colour (fashion_compose_colours)
  std::string position;              // nearest named position (fashion_compose_positions)
  std::array<int64_t, 4> box{};      // x0, y0, x1, y1 on the canvas, x1/y1 exclusive
  std::array<double, 2> centre{};    // the box's centre, x and y in canvas pixels
  int64_t pixels = 0;                // pixels above the threshold
  std::array<float, 3> hue{};        // median colour of its bright pixels, scaled so the largest channel is 1
  torch::Tensor crop;                // [1, 28, 28] classifier_input of the item alone
  // Set by classify_objects:
  std::string item;
  int64_t label = -1;
  double confidence = 0;
};

// The items of a [3, H, W] picture in [0, 1], largest first.
std::vector<MeasuredObject> find_objects(const torch::Tensor& image, const MeasureOptions& options = {});

// Names each object's item with the classifier; returns their features, [N, features].
torch::Tensor classify_objects(models::ItemClassifier& model, std::vector<MeasuredObject>& objects);

// The named colour whose hue (largest channel scaled to 1) is nearest to `rgb`'s.
std::string nearest_colour(const std::array<float, 3>& rgb);
// The named position whose centre is nearest to (x, y) on a canvas of `canvas_size` pixels.
std::string nearest_position(double x, double y, int64_t canvas_size);

}  // namespace dalle::eval
