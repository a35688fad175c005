#pragma once
// Trains CLIP on an image-caption dataset as CLIP and open_clip do: captions tokenized with
// our SentencePiece tokenizer, the symmetric cross-entropy of the image-text logits
// (every other caption and image of the batch a negative), the temperature learned through
// logit_scale (clamped to [0, ln 100] after each update), AdamW (decay on matrices only)
// with a linear warmup and a cosine learning rate, an optional EMA, and the shared
// precision section. Validation logs image->text and text->image top-1 retrieval accuracy
// on held-out images. hard_negatives fills part of each batch with images whose captions
// differ from another's in one span (data::CaptionNeighbours); word_dropout shows a share
// of the captions without dropped_words (data::caption_words.h). The run directory,
// checkpoints and exact resume are the other trainers'.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/models/clip.h"
#include "dalle/train/trainers/dvae_trainer.h"
#include "dalle/train/precision.h"
#include "dalle/train/recipe.h"
#include "dalle/train/schedule.h"

namespace dalle::train {

// The model section's defaults are ViT-B/32's, except the pooling: captions from our
// SentencePiece tokenizer end with id 3 (eos_id's default), which is not their largest id.
inline models::ClipConfig clip_training_model_defaults() {
  models::ClipConfig model;
  model.text_pooling = "eos";
  return model;
}

struct ClipTrainConfig {
  std::string kind = "clip";
  models::ClipConfig model = clip_training_model_defaults();
  data::ImageDataConfig data;
  std::string tokenizer;  // SentencePiece model (its <model>.yaml sets the caption length)
  std::string through_tokenizer;  // image tokenizer whose round trip every image takes; empty: none
  int64_t through_tokenizer_cache_mb = 4096;  // round trips kept after their first use (0: none)
  double hard_negatives = 0.0;    // share of each batch replaced by caption neighbours of the rest
  double word_dropout = 0.0;      // share of training captions shown without dropped_words
  std::vector<std::string> dropped_words;
  int64_t warmup_steps = 100;
  CosineSchedule learning_rate{5e-4, 0.0, 10'000};
  // CLIP's AdamW for ViTs: betas 0.9, 0.98, epsilon 1e-6, weight decay 0.2 on the matrices
  // and embeddings only (gains, biases, the class embedding and logit_scale have none).
  OptimizerConfig optimizer{.beta1 = 0.9, .beta2 = 0.98, .epsilon = 1e-6, .weight_decay = 0.2, .ema_decay = 0.0,
                            .trainable = {}};
  RunConfig run{.steps = 10'000, .log_every = 100, .validate_every = 1000, .checkpoint_every = 1000};
  PrecisionConfig precision;
  DistributedConfig distributed;
  double max_logit_scale = 4.605170185988092;  // ln 100
  int64_t validation_images = 256;

  void visit(ConfigVisitor& v);
  double learning_rate_at(int64_t step) const;
};

struct ClipStepMetrics {
  int64_t step = 0;  // updates done, this one included
  double loss = 0;
  double accuracy = 0;     // image->text top-1 within the batch
  double logit_scale = 0;  // after the update and the clamp; the temperature is its exp's inverse
  double learning_rate = 0;
  bool skipped = false;    // non-finite gradients (fp16): the weights were left as they were
};

struct ClipValidation {
  int64_t images = 0;           // held-out images scored, each with one of its captions
  double image_to_text = 0;     // fraction of images whose best caption is theirs
  double text_to_image = 0;     // fraction of captions whose best image is theirs
  double loss = 0;              // the contrastive loss over all of them as one batch
};

class ClipTrainer {
 public:
  // Creates `run_directory` or resumes the run in it.
  ClipTrainer(ClipTrainConfig config, std::string run_directory);
  ~ClipTrainer();

  // Trains until config.run.steps updates are done, validating and checkpointing on schedule,
  // or until a stop is requested (stop_request.h): then it checkpoints and returns early.
  void run();
  int64_t step() const;
  // Retrieval accuracy on the first validation_images held-out images, with the EMA weights.
  // A caption counts as retrieved when its text equals the image's own caption (fashion-
  // compose repeats captions across images).
  ClipValidation validate();
  models::Clip& model();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// CLIP's loss: the mean of the cross-entropies of logits_per_image and logits_per_text
// against the diagonal. `logits_per_image` [N, N], row i's positive is column i.
torch::Tensor clip_contrastive_loss(const torch::Tensor& logits_per_image);

}  // namespace dalle::train
