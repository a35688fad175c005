#include "dalle/data/fashion_compose.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <torch/torch.h>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/image.h"
#include "dalle/data/sampler.h"
#include "dalle/error.h"
#include "dalle/io/atomic_file.h"
#include "dalle/log.h"

namespace dalle::data {
namespace fs = std::filesystem;

const std::vector<NamedColour>& fashion_compose_colours() {
  static const std::vector<NamedColour> colours = {
      {"red", {0.90f, 0.12f, 0.12f}},    {"orange", {0.98f, 0.55f, 0.05f}},
      {"yellow", {0.95f, 0.88f, 0.10f}}, {"green", {0.10f, 0.72f, 0.20f}},
      {"cyan", {0.10f, 0.80f, 0.88f}},   {"blue", {0.15f, 0.30f, 0.95f}},
      {"purple", {0.60f, 0.20f, 0.82f}}, {"white", {0.96f, 0.96f, 0.96f}},
  };
  return colours;
}

const std::vector<std::string>& fashion_compose_positions() {
  static const std::vector<std::string> positions = {"left", "right", "top", "bottom", "center"};
  return positions;
}

std::array<double, 2> fashion_compose_position_centre(const std::string& position) {
  if (position == "left") return {0.25, 0.5};
  if (position == "right") return {0.75, 0.5};
  if (position == "top") return {0.5, 0.25};
  if (position == "bottom") return {0.5, 0.75};
  if (position == "center") return {0.5, 0.5};
  throw Error("fashion-compose: unknown position '" + position + "'");
}

namespace {

std::string position_phrase(const std::string& position) {
  if (position == "left" || position == "right") return "on the " + position;
  if (position == "center") return "in the center";
  return "at the " + position;
}

constexpr const char* kJoin = " and ";

}  // namespace

std::string fashion_compose_phrase(const std::string& colour, const std::string& item, const std::string& position) {
  return with_article(colour + " " + item) + " " + position_phrase(position);
}

std::string fashion_compose_caption(const std::vector<std::string>& phrases) {
  std::string caption;
  for (size_t i = 0; i < phrases.size(); ++i) caption += (i == 0 ? "" : kJoin) + phrases[i];
  return caption;
}

std::optional<std::vector<CaptionObject>> parse_fashion_compose_caption(const std::string& caption) {
  // Every phrase the grammar can write, from the same function that writes them.
  static const auto phrases = [] {
    std::map<std::string, CaptionObject> all;
    const auto& classes = fashion_mnist_classes();
    for (const auto& colour : fashion_compose_colours()) {
      for (size_t label = 0; label < classes.size(); ++label) {
        for (const auto& position : fashion_compose_positions()) {
          all[fashion_compose_phrase(colour.name, classes[label], position)] =
              CaptionObject{colour.name, classes[label], static_cast<int64_t>(label), position};
        }
      }
    }
    return all;
  }();
  std::string text;
  for (char c : caption) {
    const char lower = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (std::isspace(static_cast<unsigned char>(lower))) {
      if (!text.empty() && text.back() != ' ') text += ' ';
    } else {
      text += lower;
    }
  }
  if (!text.empty() && text.back() == ' ') text.pop_back();
  if (!text.empty() && text.back() == '.') text.pop_back();
  if (!text.empty() && text.back() == ' ') text.pop_back();
  if (text.empty()) return std::nullopt;
  // No colour, item or position contains " and ", so the phrases split cleanly.
  std::vector<CaptionObject> objects;
  for (size_t start = 0;;) {
    const size_t end = text.find(kJoin, start);
    const auto found = phrases.find(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (found == phrases.end()) return std::nullopt;
    objects.push_back(found->second);
    if (end == std::string::npos) break;
    start = end + std::char_traits<char>::length(kJoin);
  }
  return objects;
}

namespace {

int64_t uniform(std::mt19937_64& rng, int64_t low, int64_t high) {  // inclusive
  return low + static_cast<int64_t>(rng() % static_cast<uint64_t>(high - low + 1));
}

double unit(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

}  // namespace

FashionComposer::FashionComposer(FashionComposeConfig config, FashionMnist items)
    : config_(std::move(config)), items_(std::move(items)) {
  if (config_.item_size > config_.canvas_size / 2) {
    throw Error("fashion-compose: item_size " + std::to_string(config_.item_size) +
                " must be at most half the canvas (" + std::to_string(config_.canvas_size / 2) + ")");
  }
  const auto labels = items_.labels.accessor<int64_t, 1>();
  for (int64_t i = 0; i < labels.size(0); ++i) items_by_label_[labels[i]].push_back(i);

  const auto& colours = fashion_compose_colours();
  const auto& classes = fashion_mnist_classes();
  std::vector<std::pair<size_t, int64_t>> heldout;
  for (const auto& entry : config_.heldout) {
    const auto space = entry.find(' ');
    const std::string colour = entry.substr(0, space);
    const std::string item = space == std::string::npos ? "" : entry.substr(space + 1);
    auto c = std::find_if(colours.begin(), colours.end(), [&](const auto& n) { return n.name == colour; });
    auto k = std::find(classes.begin(), classes.end(), item);
    if (c == colours.end() || k == classes.end()) {
      throw Error("fashion-compose: heldout entry '" + entry +
                  "' is not '<colour> <item>' with a known colour and Fashion-MNIST item");
    }
    heldout.emplace_back(static_cast<size_t>(c - colours.begin()), static_cast<int64_t>(k - classes.begin()));
  }
  for (size_t c = 0; c < colours.size(); ++c) {
    for (int64_t label = 0; label < 10; ++label) {
      if (items_by_label_[label].empty()) continue;
      const bool held = std::find(heldout.begin(), heldout.end(), std::make_pair(c, label)) != heldout.end();
      (held ? heldout_ : seen_).push_back({c, label});
      all_.push_back({c, label});
    }
  }
  if (seen_.empty()) throw Error("fashion-compose: every combination is held out");
}

bool FashionComposer::is_heldout(const std::string& colour, int64_t label) const {
  return std::any_of(heldout_.begin(), heldout_.end(), [&](const Combination& h) {
    return fashion_compose_colours()[h.colour].name == colour && h.label == label;
  });
}

FashionComposer::Combination FashionComposer::draw(const std::vector<Combination>& from,
                                                   std::mt19937_64& rng) const {
  return from[rng() % from.size()];
}

ComposedObject FashionComposer::place(const Combination& combination, const std::string& position,
                                      torch::Tensor& canvas, std::mt19937_64& rng) const {
  const auto& candidates = items_by_label_[combination.label];
  const int64_t source = candidates[rng() % candidates.size()];
  auto item = items_.images[source].to(torch::kFloat32).unsqueeze(0);
  item = item / item.max().clamp_min(1.0);  // full-strength colour whatever the item's brightness
  if (config_.item_size != item.size(1)) item = resize(item, config_.item_size, config_.item_size);
  const auto& rgb = fashion_compose_colours()[combination.colour].rgb;
  auto coloured = item * torch::tensor({rgb[0], rgb[1], rgb[2]}).view({3, 1, 1});

  const int64_t size = config_.item_size, canvas_size = config_.canvas_size;
  const auto [fx, fy] = fashion_compose_position_centre(position);
  int64_t left = std::llround(fx * canvas_size) - size / 2 + uniform(rng, -config_.jitter, config_.jitter);
  int64_t top = std::llround(fy * canvas_size) - size / 2 + uniform(rng, -config_.jitter, config_.jitter);
  left = std::clamp<int64_t>(left, 0, canvas_size - size);
  top = std::clamp<int64_t>(top, 0, canvas_size - size);
  auto region = canvas.slice(1, top, top + size).slice(2, left, left + size);
  region.copy_(torch::maximum(region, coloured));

  ComposedObject object;
  object.item = fashion_mnist_classes()[combination.label];
  object.label = combination.label;
  object.colour = fashion_compose_colours()[combination.colour].name;
  object.position = position;
  object.source_index = source;
  auto visible = (item[0] > 0.1).nonzero();
  if (visible.size(0) > 0) {
    auto ys = visible.select(1, 0), xs = visible.select(1, 1);
    object.box = {left + xs.min().item<int64_t>(), top + ys.min().item<int64_t>(),
                  left + xs.max().item<int64_t>() + 1, top + ys.max().item<int64_t>() + 1};
  }
  return object;
}

ComposedImage FashionComposer::compose(ComposeSplit split, std::mt19937_64& rng) const {
  if (split == ComposeSplit::heldout && heldout_.empty()) {
    throw Error("fashion-compose: the heldout split needs at least one held-out combination");
  }
  const bool two = unit(rng) < config_.two_item_fraction;
  std::vector<std::string> positions;
  if (two) positions = unit(rng) < 0.5 ? std::vector<std::string>{"left", "right"}
                                       : std::vector<std::string>{"top", "bottom"};
  else positions = {fashion_compose_positions()[rng() % fashion_compose_positions().size()]};

  ComposedImage composed;
  composed.image = torch::zeros({3, config_.canvas_size, config_.canvas_size});
  std::vector<std::string> phrases;
  for (size_t i = 0; i < positions.size(); ++i) {
    const auto& pool = split != ComposeSplit::heldout ? seen_ : (i == 0 ? heldout_ : all_);
    auto object = place(draw(pool, rng), positions[i], composed.image, rng);
    phrases.push_back(fashion_compose_phrase(object.colour, object.item, object.position));
    composed.objects.push_back(std::move(object));
  }
  if (phrases.size() == 2 && unit(rng) < 0.5) std::swap(phrases[0], phrases[1]);
  composed.caption = fashion_compose_caption(phrases);
  return composed;
}

namespace {

nlohmann::json to_json(const std::string& image, const ComposedImage& composed) {
  nlohmann::json objects = nlohmann::json::array();
  for (const auto& object : composed.objects) {
    objects.push_back({{"item", object.item}, {"label", object.label}, {"colour", object.colour},
                       {"position", object.position}, {"box", object.box},
                       {"source_index", object.source_index}});
  }
  return {{"image", image}, {"caption", composed.caption}, {"objects", objects}};
}

void build_split(const FashionComposer& composer, ComposeSplit split, const std::string& name,
                 int64_t count, uint64_t seed, const fs::path& out) {
  if (count == 0) return;
  const fs::path root = out / name;
  fs::create_directories(root / "images");
  std::ostringstream lines;
  log::Progress progress("fashion-compose " + name, count);
  for (int64_t i = 0; i < count; ++i) {
    // One stream per image: any image can be rebuilt alone, whatever the count.
    std::mt19937_64 rng(mix_seed(seed, static_cast<uint64_t>(split), static_cast<uint64_t>(i)));
    const auto composed = composer.compose(split, rng);
    char file[32];
    std::snprintf(file, sizeof file, "images/%06lld.png", static_cast<long long>(i));
    write_png((root / file).string(), composed.image);
    lines << to_json(file, composed).dump() << '\n';
    progress.advance();
  }
  progress.finish();
  io::write_file_atomic((root / "captions.jsonl").string(), lines.str());
}

}  // namespace

void build_fashion_compose(const FashionComposeConfig& config, const std::string& out) {
  const fs::path root(out);
  fs::create_directories(root);
  auto config_copy = config;
  save_config((root / "config.yaml").string(), visit_of(config_copy));
  const auto seed = static_cast<uint64_t>(config.seed);
  if (config.train_images > 0) {
    FashionComposer train(config, load_fashion_mnist("train", config.source));
    build_split(train, ComposeSplit::train, "train", config.train_images, seed, root);
  }
  if (config.test_images > 0 || config.heldout_images > 0) {
    FashionComposer test(config, load_fashion_mnist("test", config.source));
    build_split(test, ComposeSplit::test, "test", config.test_images, seed, root);
    build_split(test, ComposeSplit::heldout, "heldout", config.heldout_images, seed, root);
  }
  for (const char* split : {"train", "test", "heldout"}) {
    if (!fs::exists(root / split / "captions.jsonl")) continue;
    write_sample_grid(*ImageCaptionDataset::open((root / split).string()),
                      (root / "sample_grid.png").string(), 16, seed);
    break;
  }
}

}  // namespace dalle::data
