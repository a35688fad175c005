#include "dalle/models/tiled_upscale.h"

#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "dalle/error.h"

namespace dalle::models {

namespace {

using torch::indexing::Slice;

// One tile along one axis: the core [core_begin, core_end) the tile's output is kept for,
// and the window [window_begin, window_begin + window) the network reads.
struct Span {
  int64_t core_begin, core_end, window_begin;
};

std::vector<Span> spans(int64_t side, int64_t tile, int64_t overlap, int64_t window) {
  std::vector<Span> out;
  for (int64_t begin = 0; begin < side; begin += tile) {
    const int64_t end = std::min(side, begin + tile);
    // Reach `overlap` before the core; at the far border slide back so the window fits.
    const int64_t window_begin = std::min(std::max<int64_t>(begin - overlap, 0), side - window);
    out.push_back({begin, end, window_begin});
  }
  return out;
}

std::string size_text(int64_t h, int64_t w) { return std::to_string(h) + "x" + std::to_string(w); }

}  // namespace

torch::Tensor upscale_tiled(const Upscaler& upscaler, int64_t scale, int64_t alignment, const torch::Tensor& images,
                            const TileOptions& options) {
  if (images.dim() != 4) throw Error("upscale_tiled: expected [batch, channels, H, W] images");
  if (scale < 1 || alignment < 1) throw Error("upscale_tiled: scale and alignment must be positive");
  if (options.tile < 0 || options.overlap < 0 || options.batch < 1) {
    throw Error("upscale_tiled: tile and overlap cannot be negative, batch must be positive");
  }
  const int64_t height = images.size(2), width = images.size(3);
  if (height % alignment != 0 || width % alignment != 0) {
    throw Error("upscale_tiled: image sides must be multiples of " + std::to_string(alignment) + ", got " +
                size_text(height, width));
  }
  if (options.tile % alignment != 0 || options.overlap % alignment != 0) {
    throw Error("upscale_tiled: tile (" + std::to_string(options.tile) + ") and overlap (" +
                std::to_string(options.overlap) + ") must be multiples of the network's pixel-unshuffle factor " +
                std::to_string(alignment));
  }
  torch::NoGradGuard no_grad;
  const int64_t tile_h = options.tile == 0 ? height : options.tile;
  const int64_t tile_w = options.tile == 0 ? width : options.tile;
  const int64_t window_h = std::min(height, tile_h + 2 * options.overlap);
  const int64_t window_w = std::min(width, tile_w + 2 * options.overlap);
  const auto rows = spans(height, tile_h, options.overlap, window_h);
  const auto columns = spans(width, tile_w, options.overlap, window_w);

  struct Placement {
    int64_t image;
    Span row, column;
  };
  std::vector<Placement> placements;
  for (int64_t b = 0; b < images.size(0); ++b) {
    for (const auto& row : rows) {
      for (const auto& column : columns) placements.push_back({b, row, column});
    }
  }

  torch::Tensor output;
  for (size_t first = 0; first < placements.size(); first += static_cast<size_t>(options.batch)) {
    const size_t last = std::min(placements.size(), first + static_cast<size_t>(options.batch));
    std::vector<torch::Tensor> windows;
    for (size_t i = first; i < last; ++i) {
      const auto& p = placements[i];
      windows.push_back(images[p.image].index({Slice(), Slice(p.row.window_begin, p.row.window_begin + window_h),
                                               Slice(p.column.window_begin, p.column.window_begin + window_w)}));
    }
    const auto upscaled = upscaler(torch::stack(windows));
    if (upscaled.dim() != 4 || upscaled.size(2) != window_h * scale || upscaled.size(3) != window_w * scale) {
      throw Error("upscale_tiled: the network turned " + size_text(window_h, window_w) + " windows into " +
                  (upscaled.dim() == 4 ? size_text(upscaled.size(2), upscaled.size(3)) : "a non-image tensor") +
                  ", expected x" + std::to_string(scale));
    }
    if (!output.defined()) {
      output = torch::empty({images.size(0), upscaled.size(1), height * scale, width * scale}, upscaled.options());
    }
    for (size_t i = first; i < last; ++i) {
      const auto& p = placements[i];
      const auto core = upscaled[static_cast<int64_t>(i - first)].index(
          {Slice(), Slice((p.row.core_begin - p.row.window_begin) * scale, (p.row.core_end - p.row.window_begin) * scale),
           Slice((p.column.core_begin - p.column.window_begin) * scale,
                 (p.column.core_end - p.column.window_begin) * scale)});
      output[p.image]
          .index({Slice(), Slice(p.row.core_begin * scale, p.row.core_end * scale),
                  Slice(p.column.core_begin * scale, p.column.core_end * scale)})
          .copy_(core);
    }
  }
  return output;
}

torch::Tensor upscale_tiled(RrdbNetImpl& net, const torch::Tensor& images, const TileOptions& options) {
  return upscale_tiled([&net](const torch::Tensor& x) { return net.forward(x); }, net.config().scale,
                       net.config().unshuffle_factor(), images, options);
}

torch::Tensor pad_symmetric(const torch::Tensor& images, int64_t before_h, int64_t after_h, int64_t before_w,
                            int64_t after_w) {
  if (images.dim() < 2) throw Error("pad_symmetric: expected images with at least two dimensions");
  const int64_t height = images.size(-2), width = images.size(-1);
  if (std::min({before_h, after_h, before_w, after_w}) < 0) throw Error("pad_symmetric: pads cannot be negative");
  if (std::max(before_h, after_h) > height || std::max(before_w, after_w) > width) {
    throw Error("pad_symmetric: cannot mirror " + std::to_string(std::max({before_h, after_h, before_w, after_w})) +
                " pixels of a " + size_text(height, width) + " image; lower the padding");
  }
  const auto mirror = [](const torch::Tensor& x, int64_t dim, int64_t before, int64_t after) {
    const int64_t side = x.size(dim);
    return torch::cat({x.narrow(dim, 0, before).flip(dim), x, x.narrow(dim, side - after, after).flip(dim)}, dim);
  };
  return mirror(mirror(images, -2, before_h, after_h), -1, before_w, after_w);
}

torch::Tensor super_resolve(RrdbNetImpl& net, const torch::Tensor& images, const SuperResolveOptions& options) {
  if (images.dim() == 3) return super_resolve(net, images.unsqueeze(0), options).squeeze(0);
  if (images.dim() != 4) throw Error("super_resolve: expected [batch, channels, H, W] or [channels, H, W] images");
  if (options.pad < 0) throw Error("super_resolve: pad cannot be negative");
  torch::NoGradGuard no_grad;
  const int64_t height = images.size(2), width = images.size(3);
  const int64_t u = net.config().unshuffle_factor(), scale = net.config().scale;
  const auto round_up = [u](int64_t side) { return (side + u - 1) / u * u; };
  const int64_t extra_h = round_up(height + 2 * options.pad) - (height + 2 * options.pad);
  const int64_t extra_w = round_up(width + 2 * options.pad) - (width + 2 * options.pad);
  // The alignment padding mirrors the padded image, so it can exceed the image by a little.
  auto padded = pad_symmetric(images, options.pad, options.pad, options.pad, options.pad);
  padded = pad_symmetric(padded, 0, extra_h, 0, extra_w);
  const auto upscaled = upscale_tiled(net, padded.to(net.parameters().front().device()), options.tiles);
  using torch::indexing::Slice;
  return upscaled
      .index({Slice(), Slice(), Slice(options.pad * scale, (options.pad + height) * scale),
              Slice(options.pad * scale, (options.pad + width) * scale)})
      .clamp(0.0, 1.0);
}

}  // namespace dalle::models
