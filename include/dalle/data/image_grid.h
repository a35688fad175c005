#pragma once
// Images tiled in rows, each with its label under it: the grids of dalle-generate and of
// the trainers' samples.
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dalle::data {

struct GridOptions {
  int64_t columns = 0;    // 0: as close to square as the count allows
  int64_t tile_size = 0;  // tiles are scaled (nearest) to this size; 0 keeps the first image's
  int64_t padding = 2;
};
// Tiles the images in rows; a non-empty `labels` (one per image) is printed under each tile,
// wrapped to the tile's width.
torch::Tensor make_grid(const std::vector<torch::Tensor>& images,
                        const std::vector<std::string>& labels = {}, const GridOptions& options = {});

}  // namespace dalle::data
