#pragma once
// Super-resolution of images of any size in tiles, as ruDALL-E runs Real-ESRGAN (192-pixel
// tiles, 24 pixels of overlap, after 15 pixels of reflect padding), with a blending rule
// that makes tiling invisible: every output pixel is taken from the one tile whose core
// holds it, and that tile's input window reaches `overlap` input pixels beyond the core on
// every side (or to the image border). When the network's receptive field reaches no
// farther than `overlap` (RrdbNetConfig::receptive_radius bounds it), the tiled result
// equals the untiled one up to float rounding; with a smaller overlap a pixel near a core's
// edge sees a window border where the whole image has content, and seams may show.
//
// The windows are all the same size (those at the border slide inwards instead of being
// cut short, so one batch can hold them), lie inside the image (the network zero-pads at
// a window's border exactly where it would zero-pad the whole image) and start at
// multiples of the network's alignment (its pixel-unshuffle factor), so that each window
// unshuffles on the same grid as the whole image.
#include <torch/types.h>

#include <cstdint>
#include <functional>

#include "dalle/models/rrdbnet.h"

namespace dalle::models {

struct TileOptions {
  int64_t tile = 192;    // side of a tile's core in input pixels; 0: the whole image at once
  int64_t overlap = 24;  // context a tile reads beyond its core on every side, in input pixels
  int64_t batch = 4;     // windows per forward pass
};

// [N, C, h, w] -> [N, C', h * scale, w * scale], each output pixel depending on the input
// near it (a convolutional network).
using Upscaler = std::function<torch::Tensor(const torch::Tensor&)>;

// Upscales [B, C, H, W] images tile by tile. H and W must be multiples of `alignment`, and
// so must options.tile and options.overlap. Runs without gradients.
torch::Tensor upscale_tiled(const Upscaler& upscaler, int64_t scale, int64_t alignment, const torch::Tensor& images,
                            const TileOptions& options);
// The same with an RRDBNet: its scale and unshuffle factor.
torch::Tensor upscale_tiled(RrdbNetImpl& net, const torch::Tensor& images, const TileOptions& options);

// Pads the last two dimensions by mirroring with the edge pixel repeated (numpy's
// "symmetric" mode, what ruDALL-E's pad_reflect does): top/left by `before`, bottom/right
// by `after`. Each pad must be at most the side it mirrors.
torch::Tensor pad_symmetric(const torch::Tensor& images, int64_t before_h, int64_t after_h, int64_t before_w,
                            int64_t after_w);

struct SuperResolveOptions {
  TileOptions tiles;
  int64_t pad = 15;  // mirrored border added before and cropped after, in input pixels
};

// ruDALL-E's RealESRGAN.predict on tensors: [B, C, H, W] (or [C, H, W]) images in [0, 1] of
// any size -> the network's upscaling, [B, C', H * scale, W * scale] in [0, 1]. The images
// are padded by options.pad on every side and up to a multiple of the unshuffle factor at
// the bottom and right, upscaled in tiles, cropped back and clamped. The network runs in
// its current mode (call eval() first) and without gradients.
torch::Tensor super_resolve(RrdbNetImpl& net, const torch::Tensor& images, const SuperResolveOptions& options = {});

}  // namespace dalle::models
