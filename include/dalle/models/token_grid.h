#pragma once
// The side of a square grid from its number of cells: an image's tokens (a prior draws
// side x side of them), or min-dalle's grid of images. Every place that needs a grid's side
// from a count asks here, so that a count no square grid holds is refused by name, never
// rounded to a grid of another size.
#include <cstdint>
#include <string_view>

namespace dalle::models {

// The side s with s * s == cells. Throws Error("<what>: ...") when `cells` is negative or
// not a square.
int64_t grid_side(int64_t cells, std::string_view what);

}  // namespace dalle::models
