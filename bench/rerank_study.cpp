// Which score picks a right candidate: CLIP's, or the prior's own. For each prompt of a
// dalle-generate folder made with keep = candidates (every candidate's sidecar has its image
// tokens and CLIP score) and each candidate judged by `dalle-eval score --details`, prints
// one JSON line per score: how often the candidate it ranks first is right, seen and
// held-out prompts apart. The prior's scores are log p(image | caption) and the pointwise
// mutual information log p(image | caption) - log p(image | empty caption), which by Bayes
// ranks one caption's candidates as the prior's posterior of the caption given each image
// (CogView's self-reranking, without a second, image-first model). Given CLIP runs or
// checkpoints after the tokenizer, each also scores the candidates' PNGs (a line per CLIP):
// other CLIPs compared on the same candidates without drawing them again. Given two or more,
// one more line ranks by the mean of their scores: an ensemble of CLIPs. Each given CLIP also
// ranks by its item contrast: for every item the caption names, the log-softmax of the
// caption's logit among the captions naming each Fashion-MNIST class there instead
// ("a red coat on the left" against "a red shirt on the left", ...), summed over the items;
// alone and added to the CLIP's score. It asks how surely the image shows the named item
// rather than a neighbouring one, which a similarity to the caption alone does not. One more
// line adds the CLIP's logit of the caption without its colour names (a CLIP trained with
// word_dropout over them knows such captions). With --colour-invariant, each CLIP also
// scores the images recoloured in every colour of the palette against the caption naming
// that colour (8 more passes over the images): a combination it never saw is scored through
// the ones it did.
// With --scores FILE, every candidate's scores are also written to FILE, one JSON line
// each, for combinations the lines above do not try. The details file must be newer than
// every candidate it judges: the PNGs are named by rank, so a folder regenerated with another
// CLIP holds other images under the same names.
//   dalle_rerank_study [--scores FILE] [--colour-invariant] GENERATED DETAILS.jsonl PRIOR TOKENIZER [CLIP ...]
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <stdexcept>
#include <nlohmann/json.hpp>

#include "dalle/data/caption_words.h"
#include "dalle/data/fashion_compose.h"
#include "dalle/data/fashion_mnist.h"
#include "dalle/data/image.h"
#include "dalle/io/atomic_file.h"
#include "dalle/models/clip.h"
#include "dalle/models/prior.h"
#include "dalle/models/trained.h"
#include "dalle/text/tokenizer.h"

namespace {

using torch::indexing::Slice;

struct Candidate {
  std::string image;
  double clip = 0, conditional = 0, unconditional = 0;
  std::vector<double> other_clips;     // the extra CLIPs' scores of the PNG
  std::vector<double> item_contrasts;  // and their item contrasts
  std::vector<double> colour_invariants;
  std::vector<double> without_colours;
  bool right = false, heldout = false;
};

// log p(tokens | caption) summed over the image positions, per row of tokens [B, grid * grid].
torch::Tensor image_log_likelihood(dalle::models::Prior& prior, const torch::Tensor& caption,
                                   const torch::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  const auto& config = prior->config();
  const auto input = torch::cat({caption.unsqueeze(0).expand({tokens.size(0), -1}), tokens}, 1);
  const auto logits = prior->forward(input.index({Slice(), Slice(0, -1)}));
  const auto image_logits = logits.index({Slice(), Slice(config.text_length - 1), Slice(config.text_classes())});
  return torch::log_softmax(image_logits, -1).gather(2, tokens.unsqueeze(2)).squeeze(2).sum(1);
}

std::vector<dalle::data::CaptionObject> caption_objects(const std::string& caption) {
  auto objects = dalle::data::parse_fashion_compose_caption(caption);
  if (!objects) throw std::runtime_error("not a fashion-compose caption: " + caption);
  return *objects;
}

std::string caption_of(const std::vector<dalle::data::CaptionObject>& objects) {
  std::vector<std::string> phrases;
  for (const auto& o : objects) phrases.push_back(dalle::data::fashion_compose_phrase(o.colour, o.item, o.position));
  return dalle::data::fashion_compose_caption(phrases);
}

// For each object of the caption, the caption with every other class named there instead.
std::vector<std::vector<std::string>> item_variants(const std::string& caption) {
  const auto objects = caption_objects(caption);
  std::vector<std::vector<std::string>> variants;
  for (size_t i = 0; i < objects.size(); ++i) {
    auto& slot = variants.emplace_back();
    for (const auto& name : dalle::data::fashion_mnist_classes()) {
      if (name == objects[i].item) continue;
      auto variant = objects;
      variant[i].item = name;
      slot.push_back(caption_of(variant));
    }
  }
  return variants;
}

torch::Tensor rgb_of(const dalle::data::NamedColour& colour) {
  return torch::tensor({colour.rgb[0], colour.rgb[1], colour.rgb[2]});
}

// The grey level of each pixel of images [N, 3, H, W], undoing the composer's colouring (an
// item is drawn as its grey levels times its colour): the pixel's projection on the palette
// colour nearest it in direction. [N, 1, H, W].
torch::Tensor grey_levels(const torch::Tensor& images) {
  std::vector<torch::Tensor> palette;
  for (const auto& colour : dalle::data::fashion_compose_colours()) palette.push_back(rgb_of(colour));
  const auto colours = torch::stack(palette);                                        // [K, 3]
  const auto dots = torch::einsum("nchw,kc->nkhw", {images, colours});               // <pixel, colour>
  const auto norms = colours.pow(2).sum(1).view({1, -1, 1, 1});                      // |colour|^2
  const auto nearest = (dots.pow(2) / norms).argmax(1, /*keepdim=*/true);            // least residual
  return (dots / norms).gather(1, nearest).clamp(0, 1);
}

// CLIP's logits of `caption` against image features [N, D]: [N].
torch::Tensor caption_logits(dalle::models::Clip& clip, const torch::Tensor& features,
                             const dalle::text::Tokenizer& tokenizer, const std::string& caption) {
  const auto tokens = torch::tensor(tokenizer.encode(caption).ids, torch::kInt64).unsqueeze(0);
  return clip->logits_from_features(features, clip->encode_text(tokens)).per_image.squeeze(1);
}

struct ClipScores {
  torch::Tensor caption;           // [N] logits of the caption
  torch::Tensor item_contrast;     // [N]
  torch::Tensor without_colours;   // [N] logits of the caption without its colour names
  torch::Tensor colour_invariant;  // [N], zeros unless asked for
};

std::vector<std::string> colour_names() {
  std::vector<std::string> names;
  for (const auto& colour : dalle::data::fashion_compose_colours()) names.push_back(colour.name);
  return names;
}

// The mean over the palette of the logits of the images recoloured in one colour against the
// caption naming that colour for every object: how well items and places match, whatever
// the colours. A combination never trained on ("an orange coat") is scored through the
// trained ones ("a red coat", "a blue coat", ...).
torch::Tensor colour_invariant_logits(dalle::models::Clip& clip, const torch::Tensor& images,
                                      const dalle::text::Tokenizer& tokenizer, const std::string& caption) {
  auto objects = caption_objects(caption);
  const auto levels = grey_levels(images);
  auto sum = torch::zeros({images.size(0)});
  for (const auto& colour : dalle::data::fashion_compose_colours()) {
    for (auto& object : objects) object.colour = colour.name;
    const auto features = clip->encode_image(
        dalle::models::clip_preprocess(levels * rgb_of(colour).view({1, 3, 1, 1}), clip->config()));
    sum += caption_logits(clip, features, tokenizer, caption_of(objects));
  }
  return sum / static_cast<double>(dalle::data::fashion_compose_colours().size());
}

ClipScores score_with_clip(dalle::models::Clip& clip, const torch::Tensor& images,
                           const dalle::text::Tokenizer& tokenizer, const std::string& caption,
                           bool colour_invariant) {
  torch::NoGradGuard no_grad;
  const auto features = clip->encode_image(dalle::models::clip_preprocess(images, clip->config()));
  const auto logits = caption_logits(clip, features, tokenizer, caption);
  auto contrast = torch::zeros_like(logits);
  for (const auto& alternatives : item_variants(caption)) {
    std::vector<torch::Tensor> all = {logits};
    for (const auto& alternative : alternatives) all.push_back(caption_logits(clip, features, tokenizer, alternative));
    contrast += logits - torch::logsumexp(torch::stack(all, 1), 1);
  }
  const auto without_colours =
      caption_logits(clip, features, tokenizer, dalle::data::without_words(caption, colour_names()));
  return {logits, contrast, without_colours,
          colour_invariant ? colour_invariant_logits(clip, images, tokenizer, caption) : torch::zeros_like(logits)};
}

std::map<std::string, nlohmann::json> read_details(const std::string& path) {
  std::map<std::string, nlohmann::json> details;
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot read the details file");
  for (std::string line; std::getline(in, line);) {
    auto judged = nlohmann::json::parse(line);
    details[judged["image"].get<std::string>()] = judged;
  }
  return details;
}

// Each prompt's candidates in `generated` that `details` judged, with their scores.
std::vector<std::vector<Candidate>> score_candidates(const std::filesystem::path& generated,
                                                    const std::map<std::string, nlohmann::json>& details,
                                                    std::filesystem::file_time_type details_written,
                                                    dalle::models::Prior& prior,
                                                    const dalle::text::Tokenizer& tokenizer,
                                                    std::vector<dalle::models::Clip>& clips,
                                                    bool colour_invariant) {
  const auto empty = dalle::models::empty_caption(prior->config().text_length).squeeze(0);
  std::map<std::string, std::vector<std::pair<nlohmann::json, std::string>>> sidecars;  // by prompt
  for (const auto& entry : std::filesystem::directory_iterator(generated)) {
    const auto png = entry.path().stem().string() + ".png";
    if (entry.path().extension() != ".json" || !details.count(png)) continue;
    if (std::filesystem::last_write_time(generated / png) > details_written) {
      throw std::runtime_error(png + " is newer than the details file: it judged other images");
    }
    std::ifstream in(entry.path());
    auto sidecar = nlohmann::json::parse(in);
    sidecars[sidecar["prompt"].get<std::string>()].emplace_back(std::move(sidecar), png);
  }
  std::vector<std::vector<Candidate>> prompts;
  for (const auto& [prompt, candidates] : sidecars) {
    const auto caption = torch::tensor(tokenizer.encode(prompt).ids, torch::kInt64);
    std::vector<torch::Tensor> tokens, images;
    for (const auto& [sidecar, png] : candidates) {
      tokens.push_back(torch::tensor(sidecar["image_tokens"].get<std::vector<int64_t>>()));
      if (!clips.empty()) images.push_back(dalle::data::read_image(generated / png));
    }
    std::vector<ClipScores> other_clips;
    for (auto& clip : clips) {
      other_clips.push_back(score_with_clip(clip, torch::stack(images), tokenizer, prompt, colour_invariant));
    }
    const auto stacked = torch::stack(tokens);
    const auto conditional = image_log_likelihood(prior, caption, stacked);
    const auto unconditional = image_log_likelihood(prior, empty, stacked);
    auto& scored = prompts.emplace_back();
    for (size_t i = 0; i < candidates.size(); ++i) {
      const auto& judged = details.at(candidates[i].second);
      std::vector<double> others, contrasts, invariants, colourless;
      for (const auto& scores : other_clips) {
        others.push_back(scores.caption[static_cast<int64_t>(i)].item<double>());
        contrasts.push_back(scores.item_contrast[static_cast<int64_t>(i)].item<double>());
        invariants.push_back(scores.colour_invariant[static_cast<int64_t>(i)].item<double>());
        colourless.push_back(scores.without_colours[static_cast<int64_t>(i)].item<double>());
      }
      scored.push_back({candidates[i].second, candidates[i].first["clip_score"].get<double>(),
                        conditional[i].item<double>(), unconditional[i].item<double>(), others, contrasts, invariants,
                        colourless, judged["correct"].get<bool>(), judged["heldout"].get<bool>()});
    }
  }
  return prompts;
}

// One JSON line per score: how often the candidate it ranks first is right.
void print_rankings(const std::vector<std::vector<Candidate>>& prompts, const std::vector<std::string>& clip_paths,
                    bool colour_invariant) {
  std::map<std::string, std::function<double(const Candidate&)>> scores = {
      {"clip", [](const Candidate& c) { return c.clip; }},
      {"prior_log_likelihood", [](const Candidate& c) { return c.conditional; }},
      {"prior_pointwise_mutual_information", [](const Candidate& c) { return c.conditional - c.unconditional; }},
  };
  for (size_t c = 0; c < clip_paths.size(); ++c) {
    scores["clip " + clip_paths[c]] = [c](const Candidate& candidate) { return candidate.other_clips[c]; };
    scores["item contrast " + clip_paths[c]] = [c](const Candidate& candidate) {
      return candidate.item_contrasts[c];
    };
    scores["clip + item contrast " + clip_paths[c]] = [c](const Candidate& candidate) {
      return candidate.other_clips[c] + candidate.item_contrasts[c];
    };
    scores["clip + without colours " + clip_paths[c]] = [c](const Candidate& candidate) {
      return candidate.other_clips[c] + candidate.without_colours[c];
    };
    if (!colour_invariant) continue;
    scores["colour-invariant " + clip_paths[c]] = [c](const Candidate& candidate) {
      return candidate.colour_invariants[c];
    };
    scores["clip + colour-invariant " + clip_paths[c]] = [c](const Candidate& candidate) {
      return candidate.other_clips[c] + candidate.colour_invariants[c];
    };
  }
  if (clip_paths.size() > 1) {
    scores["clip ensemble (mean of the given CLIPs' scores)"] = [](const Candidate& candidate) {
      double sum = 0;
      for (const double score : candidate.other_clips) sum += score;
      return sum / static_cast<double>(candidate.other_clips.size());
    };
  }
  for (const auto& [name, score] : scores) {
    std::map<bool, std::pair<int, int>> right_of;  // heldout -> (right, prompts)
    for (const auto& candidates : prompts) {
      const auto best = std::max_element(candidates.begin(), candidates.end(),
                                         [&](const auto& a, const auto& b) { return score(a) < score(b); });
      right_of[best->heldout].first += best->right;
      right_of[best->heldout].second += 1;
    }
    const auto share = [&](bool heldout) {
      const auto [right, total] = right_of[heldout];
      return total ? static_cast<double>(right) / total : 0.0;
    };
    std::cout << nlohmann::json{{"ranked_by", name}, {"seen", share(false)}, {"heldout", share(true)},
                                {"prompts", prompts.size()}}
                     .dump()
              << "\n";
  }
}

// Written whole or not at all, as every file the tools write.
void write_scores(const std::vector<std::vector<Candidate>>& prompts, const std::string& path) {
  dalle::io::write_file_atomic(path, [&](std::ostream& out) {
    for (const auto& candidates : prompts) {
      for (const auto& c : candidates) {
        out << nlohmann::json{{"image", c.image}, {"clip", c.clip}, {"prior_log_likelihood", c.conditional},
                              {"prior_unconditional", c.unconditional}, {"other_clips", c.other_clips},
                              {"item_contrasts", c.item_contrasts},
                              {"colour_invariants", c.colour_invariants},
                              {"without_colours", c.without_colours},
                              {"right", c.right}, {"heldout", c.heldout}}
                   .dump()
            << "\n";
      }
    }
  });
}

}  // namespace

int study(int argc, char** argv) {
  const std::string usage =
      "usage: dalle_rerank_study [--scores FILE] [--colour-invariant] GENERATED DETAILS.jsonl PRIOR TOKENIZER "
      "[CLIP ...]\n";
  if (argc > 1 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::cout << usage;
    return 0;
  }
  std::string scores_path;
  bool colour_invariant = false;
  while (argc > 1 && std::string(argv[1]).rfind("--", 0) == 0) {
    const std::string option = argv[1];
    if (option == "--scores" && argc > 2) {
      scores_path = argv[2];
      argc -= 2;
      argv += 2;
    } else if (option == "--colour-invariant") {
      colour_invariant = true;
      argc -= 1;
      argv += 1;
    } else {
      std::cerr << usage;
      return 2;
    }
  }
  if (argc < 5) {
    std::cerr << usage;
    return 2;
  }
  const std::filesystem::path generated = argv[1];
  const auto details = read_details(argv[2]);
  auto prior = dalle::models::load_trained_prior(argv[3], torch::kFloat32);
  const auto tokenizer = dalle::text::Tokenizer::load(argv[4]);
  std::vector<std::string> clip_paths(argv + 5, argv + argc);
  std::vector<dalle::models::Clip> clips;
  for (const auto& path : clip_paths) clips.push_back(dalle::models::load_trained_clip(path));

  const auto prompts = score_candidates(generated, details, std::filesystem::last_write_time(argv[2]), prior.model,
                                        tokenizer, clips, colour_invariant);
  if (prompts.empty()) {
    throw std::runtime_error(generated.string() + ": no candidate sidecar matches an image of the details file");
  }
  print_rankings(prompts, clip_paths, colour_invariant);
  if (!scores_path.empty()) write_scores(prompts, scores_path);
  return 0;
}

int main(int argc, char** argv) {
  try {
    return study(argc, argv);
  } catch (const std::exception& error) {
    std::cerr << "dalle_rerank_study: " << error.what() << "\n";
    return 1;
  }
}
