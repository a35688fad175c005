#include "dalle/eval/score.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "dalle/data/fashion_compose.h"
#include "dalle/data/image.h"
#include "dalle/error.h"
#include "dalle/eval/frechet_distance.h"
#include "dalle/input_limits.h"
#include "dalle/io/atomic_file.h"
#include "dalle/log.h"
#include "dalle/models/item_classifier.h"
#include "dalle/models/trained.h"
#include "dalle/runtime.h"

namespace dalle::eval {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json tally_json(const AccuracyTally& t) {
  return {{"images", t.images},
          {"caption_accuracy", t.caption_accuracy()},
          {"count_accuracy", t.count_accuracy()},
          {"objects", t.objects},
          {"colour_accuracy", t.colour_accuracy()},
          {"item_accuracy", t.item_accuracy()},
          {"position_accuracy", t.position_accuracy()}};
}

json split_json(const AccuracySplit& s) {
  return {{"all", tally_json(s.all)}, {"seen", tally_json(s.seen)}, {"heldout", tally_json(s.heldout)}};
}

json split_json(const AnyImageSplit& s) {
  const auto tally = [](const AnyImageTally& t) {
    return json{{"prompts", t.prompts}, {"caption_accuracy", t.caption_accuracy()}};
  };
  return {{"all", tally(s.all)}, {"seen", tally(s.seen)}, {"heldout", tally(s.heldout)}};
}

// What one fashion-compose split's captions.jsonl lists: image paths and captions.
struct RealImage {
  std::string path, caption;
};

std::vector<RealImage> read_real_split(const std::string& split, int64_t limit) {
  const fs::path file = fs::path(split) / "captions.jsonl";
  if (!fs::is_directory(split)) throw Error(split + ": no such folder (expected a fashion-compose split)");
  std::ifstream in(file);
  if (!in) throw Error(file.string() + ": cannot read (expected a fashion-compose split with captions.jsonl)");
  std::vector<RealImage> images;
  const auto line_limit = static_cast<size_t>(max_caption_line_bytes());
  std::string line;
  for (int64_t line_number = 1;
       read_line_within(in, line_limit, line, file.string(), line_number, "one image and caption a line");
       ++line_number) {
    if (line.empty()) continue;
    const auto entry = json::parse(line, nullptr, false);
    if (!entry.is_object() || !entry.contains("image") || !entry["image"].is_string() || !entry.contains("caption") ||
        !entry["caption"].is_string()) {
      throw Error(file.string() + ":" + std::to_string(line_number) + ": expected {\"image\": ..., \"caption\": ...}");
    }
    images.push_back({(fs::path(split) / entry["image"].get<std::string>()).string(),
                      entry["caption"].get<std::string>()});
    if (limit > 0 && static_cast<int64_t>(images.size()) >= limit) break;
  }
  if (images.empty()) throw Error(file.string() + ": no images listed");
  return images;
}

class Scorer {
 public:
  Scorer(const ScoreOptions& options, const std::string& split_near) : options_(options), measure_(options.measure) {
    set_torch_threads(options.threads);
    if (options.classifier.empty()) {
      throw Error("score: a classifier is required (dalle-eval train-classifier makes one)");
    }
    classifier_ = models::load_item_classifier(options.classifier);
    read_dataset_config(split_near);
    report.judgement = judgement_name(measure_);
    report.threshold = item_threshold(measure_);
    report.bridge_contrast = item_bridge_contrast(measure_);
    report.classifier = options.classifier;
    report.classifier_test_accuracy = classifier_.test_accuracy;
    report.heldout = heldout_;
    report.heldout_from = heldout_from_;
    if (!options.tokenizer_run.empty()) report.tokenizer = read_tokenizer_psnr(options.tokenizer_run);
  }

  // The image at `path`, or nothing when it cannot be read: counted as unreadable and warned of.
  std::optional<torch::Tensor> read(const std::string& path) {
    try {
      return data::read_image(path);
    } catch (const Error& error) {
      ++report.unreadable;
      log::warn("score: ", error.what(), "; not scored");
      return std::nullopt;
    }
  }

  // Scores one picture against its prompt (the prompt_index-th); a prompt the caption grammar
  // cannot write is counted as unparsed and not scored.
  void score(const torch::Tensor& image, const std::string& prompt, int64_t prompt_index, int64_t rank,
             const std::string& name) {
    const auto caption = data::parse_fashion_compose_caption(prompt);
    if (!caption) {
      ++report.unparsed;
      log::warn("score: ", name, ": prompt ", excerpt(prompt), " is not a fashion-compose caption; not scored");
      return;
    }
    auto objects = find_objects(image, measure_);
    const auto features = classify_objects(classifier_.model, objects);
    if (rank == 0 && features.size(0) > 0) features_.push_back(features);
    const auto verdict = judge_caption(*caption, objects, measure_.canvas_size);
    const bool held = names_heldout_combination(*caption, heldout_);
    auto& outcome = prompts_[prompt_index];
    outcome.heldout = held;
    outcome.right = outcome.right || verdict.correct;
    for (auto* split : rank == 0 ? std::vector<AccuracySplit*>{&report.every, &report.best}
                                 : std::vector<AccuracySplit*>{&report.every}) {
      split->all.add(verdict);
      (held ? split->heldout : split->seen).add(verdict);
    }
    ++report.images;
    if (!options_.details.empty()) details_ << detail_line(name, prompt, rank, held, objects, verdict).dump() << '\n';
  }

  void finish() {
    for (const auto& [index, outcome] : prompts_) {
      for (auto* tally : {&report.any.all, outcome.heldout ? &report.any.heldout : &report.any.seen}) {
        ++tally->prompts;
        tally->right += outcome.right;
      }
    }
    if (!options_.details.empty()) io::write_file_atomic(options_.details, details_.str());
    if (options_.real.empty()) return;
    FidResult fid;
    fid.real = options_.real;
    const auto real = read_real_split(options_.real, options_.real_limit);
    std::vector<torch::Tensor> real_features;
    log::Progress progress("FID real items", static_cast<int64_t>(real.size()));
    for (const auto& image : real) {
      auto objects = find_objects(data::read_image(image.path), measure_);
      const auto features = classify_objects(classifier_.model, objects);
      if (features.size(0) > 0) real_features.push_back(features);
      progress.advance();
    }
    progress.finish();
    fid.real_images = static_cast<int64_t>(real.size());
    const auto generated = features_.empty() ? torch::zeros({0, 0}) : torch::cat(features_);
    const auto reference = real_features.empty() ? torch::zeros({0, 0}) : torch::cat(real_features);
    fid.generated_items = generated.size(0);
    fid.real_items = reference.size(0);
    if (fid.generated_items < 2 || fid.real_items < 2) {
      log::warn("score: FID needs at least 2 items on each side (", fid.generated_items, " generated, ",
                fid.real_items, " real); not computed");
      return;
    }
    fid.value = frechet_distance(generated, reference);
    report.fid = fid;
  }

  ScoreReport report;

 private:
  void read_dataset_config(const std::string& split_near) {
    std::vector<std::string> candidates;
    if (!options_.dataset_config.empty()) {
      if (!fs::exists(options_.dataset_config)) throw Error(options_.dataset_config + ": no such dataset config");
      candidates.push_back(options_.dataset_config);
    } else {
      for (const auto& split : {split_near, options_.real}) {
        if (!split.empty()) candidates.push_back((fs::path(split) / ".." / "config.yaml").lexically_normal().string());
      }
    }
    for (const auto& path : candidates) {
      if (!fs::exists(path)) continue;
      const auto config = load_config<data::FashionComposeConfig>(ConfigSource::from_file(path));
      heldout_ = config.heldout;
      heldout_from_ = path;
      measure_.canvas_size = config.canvas_size;
      measure_.item_size = config.item_size;
      return;
    }
    heldout_ = data::FashionComposeConfig{}.heldout;
    heldout_from_ = "defaults";
    log::warn("score: no dataset config.yaml found (give --dataset-config); using the default held-out list");
  }

  json detail_line(const std::string& name, const std::string& prompt, int64_t rank, bool held,
                   const std::vector<MeasuredObject>& objects, const CaptionVerdict& verdict) const {
    json measured = json::array();
    for (const auto& o : objects) {
      measured.push_back({{"colour", o.colour}, {"item", o.item}, {"position", o.position}, {"box", o.box},
                          {"pixels", o.pixels}, {"confidence", o.confidence}});
    }
    json asked = json::array();
    for (const auto& v : verdict.objects) {
      asked.push_back({{"found", v.found}, {"colour", v.colour}, {"item", v.item}, {"position", v.position}});
    }
    return {{"image", name}, {"prompt", prompt}, {"rank", rank}, {"heldout", held}, {"correct", verdict.correct},
            {"count", verdict.count}, {"objects", asked}, {"measured", measured}};
  }

  ScoreOptions options_;
  MeasureOptions measure_;
  models::TrainedClassifier classifier_;
  std::vector<std::string> heldout_;
  std::string heldout_from_;
  std::vector<torch::Tensor> features_;
  struct PromptOutcome {
    bool heldout = false, right = false;
  };
  std::map<int64_t, PromptOutcome> prompts_;
  std::ostringstream details_;
};

// The rank and prompt index a dalle-generate file name (PPPP-RR) gives, for sidecars that
// predate those keys.
std::pair<int64_t, int64_t> indices_from_stem(const std::string& stem) {
  const auto dash = stem.find('-');
  try {
    if (dash != std::string::npos) return {std::stoll(stem.substr(0, dash)), std::stoll(stem.substr(dash + 1))};
  } catch (const std::exception&) {
  }
  return {0, 0};
}

// An image as the tokenizer's decoder gives it back, at the size the tokenizer was trained at.
torch::Tensor through_tokenizer(models::TrainedImageTokenizer& tokenizer, const torch::Tensor& image) {
  auto input = image;
  if (input.size(1) != tokenizer.image_size || input.size(2) != tokenizer.image_size) {
    input = data::resize(input, tokenizer.image_size, tokenizer.image_size);
  }
  return models::round_trip(tokenizer, input.unsqueeze(0))[0];
}

}  // namespace

ScoreReport score_generated(const std::string& directory, const ScoreOptions& options) {
  if (!fs::is_directory(directory)) throw Error(directory + ": no such folder of generated images");
  struct Sidecar {
    std::string image, prompt;
    int64_t prompt_index = 0, rank = 0;
    bool clip = false;
  };
  std::vector<Sidecar> sidecars;
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(directory)) {
    if (entry.path().extension() == ".json") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  for (const auto& file : files) {
    std::ifstream in(file);
    const auto sidecar = json::parse(in, nullptr, false);
    if (!sidecar.is_object() || !sidecar.contains("prompt") || !sidecar["prompt"].is_string()) continue;
    Sidecar s;
    s.image = fs::path(file).replace_extension(".png").string();
    s.prompt = sidecar["prompt"].get<std::string>();
    std::tie(s.prompt_index, s.rank) = indices_from_stem(file.stem().string());
    if (sidecar.contains("rank") && sidecar["rank"].is_number_integer()) s.rank = sidecar["rank"].get<int64_t>();
    if (sidecar.contains("prompt_index") && sidecar["prompt_index"].is_number_integer()) {
      s.prompt_index = sidecar["prompt_index"].get<int64_t>();
    }
    s.clip = sidecar.contains("clip_score") && sidecar["clip_score"].is_number();
    sidecars.push_back(std::move(s));
    if (options.limit > 0 && static_cast<int64_t>(sidecars.size()) >= options.limit) break;
  }
  if (sidecars.empty()) {
    throw Error(directory + ": no dalle-generate sidecars here (PPPP-RR.json files with a \"prompt\")");
  }

  Scorer scorer(options, "");
  auto& report = scorer.report;
  report.kind = "generated";
  report.source = directory;
  std::map<int64_t, int64_t> per_prompt;
  log::Progress progress("score", static_cast<int64_t>(sidecars.size()));
  for (const auto& s : sidecars) {
    progress.advance();
    const auto image = scorer.read(s.image);
    if (!image) continue;
    ++per_prompt[s.prompt_index];
    report.reranked = report.reranked || s.clip;
    scorer.score(*image, s.prompt, s.prompt_index, s.rank, fs::path(s.image).filename().string());
  }
  progress.finish();
  if (per_prompt.empty()) {
    throw Error(directory + ": none of its " + std::to_string(sidecars.size()) +
                " images could be read; nothing to score");
  }
  report.prompts = static_cast<int64_t>(per_prompt.size());
  for (const auto& [prompt, count] : per_prompt) report.images_per_prompt = std::max(report.images_per_prompt, count);
  scorer.finish();
  return report;
}

ScoreReport score_real(const std::string& split, const ScoreOptions& options) {
  const auto images = read_real_split(split, options.limit);
  Scorer scorer(options, split);
  auto& report = scorer.report;
  report.kind = "real";
  report.source = split;
  std::optional<models::TrainedImageTokenizer> tokenizer;
  if (!options.through_tokenizer.empty()) {
    tokenizer = models::load_image_tokenizer(options.through_tokenizer);
    report.through_tokenizer = options.through_tokenizer;
  }
  log::Progress progress("score", static_cast<int64_t>(images.size()));
  for (const auto& image : images) {
    progress.advance();
    auto picture = scorer.read(image.path);
    if (!picture) continue;
    if (tokenizer) picture = through_tokenizer(*tokenizer, *picture);
    scorer.score(*picture, image.caption, report.images, 0, fs::path(image.path).filename().string());
  }
  progress.finish();
  if (report.unreadable == static_cast<int64_t>(images.size())) {
    throw Error(split + ": none of its " + std::to_string(images.size()) + " images could be read; nothing to score");
  }
  report.prompts = report.images;
  report.images_per_prompt = 1;
  scorer.finish();
  return report;
}

TokenizerPsnr read_tokenizer_psnr(const std::string& run) {
  const fs::path file = fs::path(run) / "metrics.jsonl";
  std::ifstream in(file);
  if (!in) throw Error(file.string() + ": cannot read (expected an image-tokenizer run directory)");
  std::optional<TokenizerPsnr> last;
  for (std::string line; std::getline(in, line);) {
    const auto entry = json::parse(line, nullptr, false);
    if (entry.is_object() && entry.contains("validation_psnr") && entry["validation_psnr"].is_number()) {
      last = TokenizerPsnr{run, entry.value("step", int64_t{0}), entry["validation_psnr"].get<double>()};
    }
  }
  if (!last) throw Error(file.string() + ": no validation_psnr line (has the run validated yet?)");
  return *last;
}

std::string ScoreReport::to_json(int indent) const {
  json out = {{"kind", kind},
              {"source", source},
              {"images", images},
              {"prompts", prompts},
              {"images_per_prompt", images_per_prompt},
              {"skipped", {{"unparsed_prompts", unparsed}, {"unreadable_images", unreadable}}},
              {"reranked", reranked},
              {"judgement", judgement},
              {"threshold", threshold},
              {"bridge_contrast", bridge_contrast},
              {"accuracy",
               {{"every_image", split_json(every)}, {"best_ranked", split_json(best)}, {"any_image", split_json(any)}}},
              {"heldout_combinations", heldout},
              {"heldout_from", heldout_from},
              {"classifier", {{"path", classifier}, {"test_accuracy", classifier_test_accuracy}}}};
  out["fid"] = fid ? json{{"value", fid->value},
                          {"generated_items", fid->generated_items},
                          {"real_items", fid->real_items},
                          {"real_images", fid->real_images},
                          {"real", fid->real}}
                   : json(nullptr);
  if (!through_tokenizer.empty()) out["through_tokenizer"] = through_tokenizer;
  if (tokenizer) {
    out["tokenizer"] = {{"run", tokenizer->run}, {"step", tokenizer->step}, {"validation_psnr", tokenizer->psnr}};
  }
  return out.dump(indent);
}

}  // namespace dalle::eval
