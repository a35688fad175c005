// dalle-eval: measures generated images. `train-classifier` trains the Fashion-MNIST item
// classifier the measurements rely on; `score` reads a dalle-generate folder and reports
// caption accuracy (seen and held-out combinations, every image and each prompt's best) and
// FID in the classifier's feature space; `score-real` measures real fashion-compose images
// against their own captions, the ceiling of the metric. Details: docs/eval.md.
#include <iostream>
#include <nlohmann/json.hpp>

#include "dalle/train/trainers/classifier_trainer.h"
#include "dalle/eval/score.h"
#include "dalle/io/atomic_file.h"
#include "dalle/io/checkpoint.h"
#include "dalle/log.h"
#include "tool_support.h"

using namespace dalle;

namespace {

struct ScoreCommand {
  eval::ScoreOptions options;
  std::string out;

  void add_to(CLI::App& command) {
    command.add_option("--classifier", options.classifier, "item classifier directory (from train-classifier)")
        ->required();
    command.add_option("--real", options.real,
                       "fashion-compose split to take FID against, e.g. demo/fashion-compose/test");
    command.add_option("--dataset-config", options.dataset_config,
                       "the dataset's config.yaml: held-out combinations, canvas and item sizes "
                       "(default: the one beside the real split)");
    command.add_option("--tokenizer-run", options.tokenizer_run,
                       "image-tokenizer run directory: report its last validation PSNR");
    command.add_option("--details", options.details, "write one JSON line per scored image here");
    command.add_option("--limit", options.limit, "score at most this many images (0: all)")
        ->check(CLI::NonNegativeNumber);
    command.add_option("--real-limit", options.real_limit, "use at most this many real images for FID (0: all)")
        ->check(CLI::NonNegativeNumber);
    command.add_option("--threshold", options.measure.threshold,
                       "a pixel belongs to an item when its brightest channel exceeds this (strict judgement; "
                       "the lenient one always uses 0.1)")
        ->check(CLI::Range(0.0, 1.0))
        ->capture_default_str();
    command.add_option("--bridge-contrast", options.measure.bridge_contrast,
                       "two bright pieces joined only by a thin bridge dimmer than this fraction of their "
                       "brightest pixel are two objects (0: joined, as before 2026-11-27's calibration)")
        ->check(CLI::Range(0.0, 1.0))
        ->capture_default_str();
    command.add_flag("--lenient", options.measure.lenient,
                     "the older, lenient judgement, to compare with figures published under it: pieces whose joint "
                     "box fits one item are one object and objects under 12 pixels are ignored (default: strict, "
                     "pieces more than " + std::to_string(options.measure.join_gap) +
                         " pixels apart are separate objects and any blob of " +
                         std::to_string(options.measure.min_pixels) + " pixels or more counts)");
    command.add_option("--threads", options.threads, "torch intra-op threads (0: one per idle core)")
        ->check(CLI::NonNegativeNumber);
  }

  void report(const eval::ScoreReport& report) const {
    const auto text = report.to_json() + "\n";
    std::cout << text;
    if (!out.empty()) {
      io::write_file_atomic(out, text);
      log::info("eval: report written to ", out);
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Measures generated images: caption accuracy from an item classifier and the pixels, FID in the "
               "classifier's feature space. See docs/eval.md."};
  app.name("dalle-eval");
  tools::add_common_options(app);
  app.require_subcommand(1);

  std::string classifier_out;
  tools::ConfigOptions classifier_config;
  auto* train_command = app.add_subcommand(
      "train-classifier", "train the Fashion-MNIST item classifier and save it as a checkpoint directory");
  train_command->add_option("--out", classifier_out,
                            std::string("classifier directory: config.yaml, ") + io::kWeightsFile);
  classifier_config.add_to(*train_command, "item classifier training");

  ScoreCommand score;
  std::string generated;
  auto* score_command = app.add_subcommand(
      "score", "score a dalle-generate folder against its prompts; JSON to stdout and to --out");
  score_command->add_option("--generated", generated, "dalle-generate output folder (PPPP-RR.png + .json)")
      ->required();
  score_command->add_option("--out", score.out, "write the JSON report here (default: <generated>/eval.json)");
  score.add_to(*score_command);

  ScoreCommand real;
  std::string split;
  auto* real_command = app.add_subcommand(
      "score-real", "score real fashion-compose images against their own captions: the metric's ceiling");
  real_command->add_option("split", split, "fashion-compose split folder, e.g. demo/fashion-compose/test")->required();
  real_command->add_option("--out", real.out, "also write the JSON report here");
  real_command->add_option("--through-tokenizer", real.options.through_tokenizer,
                           "encode and decode every image with this dVAE/VQGAN run first: the ceiling of a "
                           "generator drawing through that decoder");
  real.add_to(*real_command);

  return tools::run_tool(app, argc, argv, [&] {
    if (*train_command) {
      auto config = load_config<train::ClassifierTrainConfig>(classifier_config.source());
      if (classifier_config.print_requested(visit_of(config))) return;
      if (classifier_out.empty()) throw tools::UsageError("train-classifier: --out is required");
      const auto result = train::train_item_classifier(config, classifier_out);
      const nlohmann::json summary = {{"classifier", classifier_out},     {"test_accuracy", result.test_accuracy},
                                      {"test_items", result.test_items},   {"train_items", result.train_items},
                                      {"epoch_losses", result.epoch_losses}, {"seconds", result.seconds}};
      std::cout << summary.dump(2) << "\n";
    } else if (*score_command) {
      if (score.out.empty()) score.out = generated + "/eval.json";
      score.report(eval::score_generated(generated, score.options));
    } else if (*real_command) {
      real.report(eval::score_real(split, real.options));
    }
  });
}
