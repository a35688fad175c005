#pragma once
// dalle-eval's measurements as library calls. score_generated reads a dalle-generate folder
// (PPPP-RR.png + PPPP-RR.json sidecars giving each image's prompt and rank) and reports how
// often the pictures show what their prompts ask for, on seen and held-out colour-item
// combinations, for every image and for each prompt's best-ranked one; FID in the item
// classifier's feature space against real fashion-compose images; and optionally the image
// tokenizer's validation PSNR. score_real does the same for a real fashion-compose split
// against its own captions: the ceiling of the measurement.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dalle/eval/caption_match.h"
#include "dalle/eval/object_measure.h"

namespace dalle::eval {

struct ScoreOptions {
  std::string classifier;      // item classifier directory (required)
  std::string real;            // fashion-compose split folder to take FID against; empty: no FID
  std::string dataset_config;  // the dataset's config.yaml (held-out list, canvas and item sizes);
                               // empty: <real>/../config.yaml when it exists, else the defaults
  std::string tokenizer_run;   // an image-tokenizer run whose last validation PSNR is reported
  std::string through_tokenizer;  // score_real only: an image-tokenizer run or checkpoint each
                                  // real image is encoded and decoded with before it is measured,
                                  // the ceiling of a generator drawing through that decoder
  std::string details;         // when set, one JSON line per scored image is written here
  int64_t limit = 0;           // score at most this many images (0: all)
  int64_t real_limit = 0;      // at most this many real images for FID (0: all)
  int64_t threads = 0;         // torch intra-op threads (0: one per idle core)
  MeasureOptions measure;      // canvas_size and item_size come from the dataset config
};

struct AccuracySplit {
  AccuracyTally all, seen, heldout;  // heldout: the caption names a held-out combination
};

// Prompts with at least one right image among all of theirs: what a perfect reranker would
// pick from the same candidates.
struct AnyImageTally {
  int64_t prompts = 0, right = 0;
  double caption_accuracy() const { return prompts > 0 ? static_cast<double>(right) / static_cast<double>(prompts) : 0; }
};

struct AnyImageSplit {
  AnyImageTally all, seen, heldout;
};

struct FidResult {
  double value = 0;
  int64_t generated_items = 0, real_items = 0;  // item crops each side's statistics came from
  int64_t real_images = 0;
  std::string real;
};

struct TokenizerPsnr {
  std::string run;
  int64_t step = 0;
  double psnr = 0;
};

struct ScoreReport {
  std::string kind;    // "generated" or "real"
  std::string source;  // the folder scored
  int64_t images = 0;  // images scored
  int64_t prompts = 0;
  int64_t images_per_prompt = 0;  // the most images any prompt has
  int64_t unparsed = 0;    // images whose prompt is outside the caption grammar (not scored)
  int64_t unreadable = 0;  // images that could not be read (not scored)
  bool reranked = false;   // the sidecars carry CLIP scores
  AccuracySplit every;     // every image
  AccuracySplit best;      // each prompt's rank-0 image (CLIP's best when reranked)
  AnyImageSplit any;       // each prompt with any right image (a perfect reranker's pick)
  std::optional<FidResult> fid;  // of each prompt's rank-0 image, the one a user keeps
  std::optional<TokenizerPsnr> tokenizer;
  std::vector<std::string> heldout;  // the held-out combinations used for the split
  std::string heldout_from;          // the config they came from ("defaults" when none)
  std::string classifier;
  double classifier_test_accuracy = 0;
  std::string through_tokenizer;     // score_real's round trip, when asked for
  std::string judgement;             // how objects were found: "strict" or "lenient" (MeasureOptions)
  double threshold = 0;              // the brightness above which a pixel was part of an item
  double bridge_contrast = 0;        // MeasureOptions::bridge_contrast as judged (0: no bridges cut)

  std::string to_json(int indent = 2) const;
};

ScoreReport score_generated(const std::string& directory, const ScoreOptions& options);
ScoreReport score_real(const std::string& split, const ScoreOptions& options);

// The last validation PSNR in a tokenizer run's metrics.jsonl.
TokenizerPsnr read_tokenizer_psnr(const std::string& run);

}  // namespace dalle::eval
