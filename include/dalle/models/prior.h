#pragma once
// DALL-E's stage 2: a decoder-only transformer over [caption BPE tokens | image tokens].
// Attention and MLP are separate pre-LayerNorm residual blocks ("resblocks"), each its own
// module, handed out as a list so that gradient scaling, activation checkpointing and
// sharding can wrap them from outside. ruDALL-E's variations (sandwich LayerNorms, tanh
// GELU, a second LayerNorm before the logits) are options of this one model; its weights
// load through `import_rudalle_state` (models/rudalle_import.h).
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "dalle/models/decode_graphs.h"
#include "dalle/models/linear.h"
#include "dalle/models/prior_config.h"
#include "dalle/models/prior_resblocks.h"

namespace dalle::models {

}  // namespace dalle::models
