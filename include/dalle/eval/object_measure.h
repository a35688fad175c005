#pragma once
// Measuring what a picture shows, the way fashion-compose draws it: coloured items on black.
// Items are found from the pixels (brightest channel above a threshold, touching items split,
// faint bridges between pieces cut, lone pixels dropped); each gets the named colour nearest
// to its bright pixels' hue, the named position nearest to its box's centre, and a crop
// framed for the item classifier, which names the item. An item drawn in detached pieces,
// or a stray blob, is more than one object, as a person counts them (the strict judgement;
// `lenient` keeps the older one).
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
  // A pixel is part of an item when its brightest channel is above this. A decoder's faint
  // bridge between two drawn pieces passes 0.1, but a higher threshold splits real items;
  // bridge_contrast cuts the bridge instead (docs/eval.md, "A faint bridge").
  double threshold = 0.1;
  // Two bright pieces joined only by a thin bridge of dim pixels are two objects, as a person
  // sees them: an object's pieces are its pixels brighter than this fraction of its brightest
  // and its dim pixels inside the item (all four neighbours above the threshold), so a dark
  // band across an item keeps it whole and a one- or two-pixel bridge does not (0: off, as
  // before 2026-11-27's calibration in docs/eval.md, "A faint bridge").
  double bridge_contrast = 0.3;
  // Bright pieces smaller than this stay with the object they touch: a handle's speck.
  int64_t bridge_min_piece = 24;
  // Pixels up to this many background pixels apart are one object; pieces farther apart are
  // separate objects. 4 keeps real items whole: stripes and straps darker than the threshold
  // leave gaps of a few pixels inside them (docs/eval.md has the calibration).
  int64_t join_gap = 4;
  // Smaller objects are dropped: lone pixels, such as the corners a VQGAN decoder lights. Any
  // larger blob is an object, so a stray one makes a caption's count wrong.
  int64_t min_pixels = 2;
  double colour_fraction = 0.5;  // the pixels at least this fraction of an item's brightest give its colour
  // The judgement made before issue 25, for comparing with figures published under it: pieces
  // whose joint box still fits one item are joined into one object, with a threshold of 0.1, a
  // join gap of 2, no bridges cut and objects under 12 pixels dropped (the options above are
  // then not used).
  bool lenient = false;
};

// "strict" or "lenient": which judgement `options` finds objects with, for reports.
std::string judgement_name(const MeasureOptions& options);
// The brightness above which `options` counts a pixel as part of an item (the lenient
// judgement's is fixed at 0.1).
double item_threshold(const MeasureOptions& options);
// The fraction of an object's brightest pixel below which thin bridges are cut (0: none, as
// in the lenient judgement).
double item_bridge_contrast(const MeasureOptions& options);

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
