#pragma once
// Whether a picture shows what its caption asks for: the caption's objects paired with the
// measured ones, each attribute compared, and tallies of the verdicts. A caption is right
// when the picture holds exactly as many items as it names and every one has the asked
// item, colour and position.
#include <cstdint>
#include <string>
#include <vector>

#include "dalle/data/fashion_compose.h"
#include "dalle/eval/object_measure.h"

namespace dalle::eval {

struct ObjectVerdict {
  bool found = false;  // a measured object was paired with it
  bool colour = false, item = false, position = false;
  bool correct() const { return found && colour && item && position; }
};

struct CaptionVerdict {
  std::vector<ObjectVerdict> objects;  // one per caption object, in caption order
  int64_t measured = 0;                // objects found in the picture
  bool count = false;                  // as many as the caption names
  bool correct = false;                // count right and every object correct
};

// Pairs each caption object with a different measured one, choosing the pairing with the
// most attributes in agreement, then the one nearest the caption's positions; so an image
// with the right items swapped gets its colours and items right and its positions wrong.
// Measured objects must have been classified (their `item` set).
CaptionVerdict judge_caption(const std::vector<data::CaptionObject>& caption,
                             const std::vector<MeasuredObject>& measured, int64_t canvas_size);

struct AccuracyTally {
  int64_t images = 0, correct = 0, count = 0;
  int64_t objects = 0, colour = 0, item = 0, position = 0, found = 0;
  void add(const CaptionVerdict& verdict);
  // Fractions (0 when empty): images with the whole caption right, images with the right
  // number of items; caption objects with the right colour, item, position.
  double caption_accuracy() const;
  double count_accuracy() const;
  double colour_accuracy() const;
  double item_accuracy() const;
  double position_accuracy() const;
};

// Whether any of the caption's colour-item pairs is among `heldout` ("<colour> <item>").
bool names_heldout_combination(const std::vector<data::CaptionObject>& caption,
                               const std::vector<std::string>& heldout);

}  // namespace dalle::eval
