// The item classifier (trained on a slice of Fashion-MNIST), its framing, its checkpoint,
// and the scoring built on it, end to end on small real datasets.
#include "dalle/train/trainers/classifier_trainer.h"

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "dalle/data/classifier_input.h"
#include "dalle/data/fashion_compose.h"
#include "dalle/data/image.h"
#include "dalle/data/sampler.h"
#include "dalle/eval/caption_match.h"
#include "dalle/eval/object_measure.h"
#include "dalle/eval/score.h"
#include "dalle/io/checkpoint.h"
#include "test_support.h"

namespace dalle::eval {
namespace {

using data::classifier_input;
using testing::ScratchDir;
using train::classifier_accuracy;
using train::classifier_inputs;
using train::ClassifierTrainConfig;
using train::train_item_classifier;
namespace fs = std::filesystem;

static_assert(data::kClassifierInputSize == models::kClassifierInputSize,
              "items are framed at the classifier's input size");

// One test trains the classifier that the rest of it measures with: ctest runs every test
// in its own process, so a suite-wide fixture would train once per test.
TEST(ItemClassifier, LearnsFashionMnistAndNamesTheItemsOfRealImages) {
  ScratchDir dir;
  ClassifierTrainConfig config;
  config.train_limit = 6000;
  config.test_limit = 2000;
  config.epochs = 2;
  const auto result = train_item_classifier(config, dir / "classifier");
  std::cout << "[ trained  ] " << result.train_items << " items, 2 epochs: test accuracy " << result.test_accuracy
            << " on " << result.test_items << " (" << result.seconds << " s)\n";
  ASSERT_EQ(result.epoch_losses.size(), 2u);
  EXPECT_LT(result.epoch_losses[1], result.epoch_losses[0]);
  EXPECT_EQ(result.train_items, 6000);
  EXPECT_EQ(result.test_items, 2000);
  EXPECT_GE(result.test_accuracy, 0.75);

  // It loads back as the model that was measured.
  for (const char* file : {"config.yaml", "model.safetensors", "state.safetensors"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir / "classifier") / file)) << file;
  }
  auto loaded = models::load_item_classifier(dir / "classifier");
  EXPECT_NEAR(loaded.test_accuracy, result.test_accuracy, 1e-6);
  EXPECT_EQ(loaded.config.features, 128);
  const auto test = data::load_fashion_mnist("test");
  const data::FashionMnist first{test.images.slice(0, 0, 2000), test.labels.slice(0, 0, 2000)};
  EXPECT_NEAR(classifier_accuracy(loaded.model, first), result.test_accuracy, 1e-9);
  const auto classified = models::classify(loaded.model, classifier_inputs(first.images.slice(0, 0, 10)));
  EXPECT_EQ(classified.features.sizes(), (std::vector<int64_t>{10, 128}));
  EXPECT_GE(classified.features.min().item<float>(), 0.0f) << "features come after a ReLU";
  EXPECT_LT((classified.probabilities.sum(1) - 1).abs().max().item<float>(), 1e-5);

  // The items of real fashion-compose images, cut out and classified, against the truth.
  data::FashionComposer composer({}, test);
  AccuracyTally tally;
  for (int64_t i = 0; i < 300; ++i) {
    std::mt19937_64 rng(mix_seed(7, static_cast<uint64_t>(i)));
    const auto composed = composer.compose(i % 4 ? data::ComposeSplit::test : data::ComposeSplit::heldout, rng);
    std::vector<data::CaptionObject> truth;
    for (const auto& o : composed.objects) truth.push_back({o.colour, o.item, o.label, o.position});
    auto objects = find_objects(data::decode_image(data::encode_png(composed.image), "composed"));
    classify_objects(loaded.model, objects);
    tally.add(judge_caption(truth, objects, 64));
  }
  std::cout << "[ measured ] 300 real images, small classifier: caption " << tally.caption_accuracy() << ", item "
            << tally.item_accuracy() << ", colour " << tally.colour_accuracy() << ", position "
            << tally.position_accuracy() << "\n";
  // The classifier's own accuracy, less a little for items framed from the canvas.
  EXPECT_GE(tally.item_accuracy(), result.test_accuracy - 0.08);
  EXPECT_GE(tally.colour_accuracy(), 0.97);
  EXPECT_GE(tally.position_accuracy(), 0.97);
  EXPECT_GE(tally.caption_accuracy(), 0.6);
}

TEST(ItemClassifier, TrainingIsFixedByTheSeed) {
  ScratchDir dir;
  ClassifierTrainConfig config;
  config.train_limit = 300;
  config.test_limit = 100;
  config.epochs = 1;
  config.batch_size = 64;
  train_item_classifier(config, dir / "a");
  train_item_classifier(config, dir / "b");
  config.seed = 1;
  train_item_classifier(config, dir / "c");
  const auto a = testing::read_text(dir / "a/model.safetensors");
  EXPECT_EQ(a, testing::read_text(dir / "b/model.safetensors"));
  EXPECT_NE(a, testing::read_text(dir / "c/model.safetensors"));
  // Training again into a classifier directory replaces it.
  config.seed = 0;
  train_item_classifier(config, dir / "c");
  EXPECT_EQ(a, testing::read_text(dir / "c/model.safetensors"));
}

TEST(ItemClassifier, RefusesForeignDirectoriesAndCheckpoints) {
  ScratchDir dir;
  fs::create_directories(dir / "notes");
  testing::write_text(dir / "notes/readme.txt", "mine");
  ClassifierTrainConfig config;
  config.train_limit = 10;
  EXPECT_THROW_WITH(train_item_classifier(config, dir / "notes"), Error, "not an item classifier directory");
  EXPECT_TRUE(fs::exists(dir / "notes/readme.txt"));
  EXPECT_THROW_WITH(models::load_item_classifier(dir / "missing"), Error, "missing", "not an item classifier directory");
  io::Checkpoint other;
  other.config_yaml = "steps: 1\n";
  other.weights["w"] = torch::zeros({1});
  io::save_checkpoint(dir / "other", other);
  EXPECT_THROW_WITH(models::load_item_classifier(dir / "other"), Error, "not an item classifier checkpoint");
}

// The two judges of scripts/eval-demo-models.
TEST(ItemClassifier, ShippedRecipesLoad) {
  for (const auto& [name, features] : {std::pair{"fashion-mnist-classifier", 128}, {"fashion-mnist-classifier-wide", 256}}) {
    const auto config = load_config<ClassifierTrainConfig>(
        ConfigSource::from_file(std::string(DALLE_SOURCE_DIR) + "/configs/eval/" + name + ".yaml"));
    EXPECT_EQ(config.model.features, features) << name;
    EXPECT_EQ(config.train_limit, 0) << name << ": a shipped recipe trains on every item";
    EXPECT_EQ(config.threads, 1) << name << ": the seed fixes a published judge's weights only at a fixed thread count";
    EXPECT_NO_THROW(models::ItemClassifier{config.model});
  }
}

TEST(ItemClassifier, FramesAnItemTheSameWhereverItIs) {
  const auto items = data::load_fashion_mnist("test").images.slice(0, 0, 20).to(torch::kFloat32);
  for (int64_t i = 0; i < items.size(0); ++i) {
    const auto alone = classifier_input(items[i]);
    EXPECT_FLOAT_EQ(alone.max().item<float>(), 1.0f);
    // On a larger black picture, off centre and dimmer: the same framing. (Halving keeps
    // the scaled brightnesses exact, so pixels at the threshold fall the same way.)
    auto wide = torch::zeros({50, 70});
    wide.slice(0, 13, 41).slice(1, 5, 33).copy_(items[i] * 0.5);
    EXPECT_LT((classifier_input(wide) - alone).abs().max().item<float>(), 1e-5) << i;
  }
  // A small item is scaled up to fill the frame along its longer side.
  auto small = torch::zeros({40, 40});
  small.slice(0, 10, 17).slice(1, 20, 34).fill_(0.5);  // 14 wide, 7 tall
  const auto framed = classifier_input(small)[0];
  EXPECT_GT(framed[14][0].item<float>(), 0.9f);
  EXPECT_GT(framed[14][27].item<float>(), 0.9f);
  EXPECT_LT(framed[2][14].item<float>(), 0.1f);
  EXPECT_EQ(classifier_input(torch::zeros({28, 28})).abs().sum().item<float>(), 0.0f);
}

// A folder laid out as dalle-generate writes it, from real images and their captions.
void fake_generation(const std::string& split, const std::string& out, int64_t count) {
  fs::create_directories(out);
  std::ifstream in(split + "/captions.jsonl");
  int64_t index = 0;
  for (std::string line; index < count && std::getline(in, line); ++index) {
    const auto entry = nlohmann::json::parse(line);
    char stem[16];
    std::snprintf(stem, sizeof stem, "%04lld-00", static_cast<long long>(index));
    fs::copy_file(split + "/" + entry["image"].get<std::string>(), out + "/" + stem + ".png");
    testing::write_text(out + "/" + stem + ".json",
                        nlohmann::json{{"prompt", entry["caption"]}, {"rank", 0}, {"prompt_index", index},
                                       {"clip_score", nullptr}}.dump());
  }
}

// The plumbing of scoring, with a classifier trained in a second: its verdicts need not be
// good, only the same wherever the images come from.
TEST(Scoring, ScoresRealSplitsAndGenerationFolders) {
  ScratchDir dir;
  ClassifierTrainConfig quick;
  quick.train_limit = 600;
  quick.test_limit = 100;
  quick.epochs = 1;
  train_item_classifier(quick, dir / "classifier");
  data::FashionComposeConfig dataset;
  dataset.train_images = 0;
  dataset.test_images = 40;
  dataset.heldout_images = 24;
  data::build_fashion_compose(dataset, dir / "fc");

  ScoreOptions options;
  options.classifier = dir / "classifier";
  options.details = dir / "details.jsonl";
  const auto heldout = score_real(dir / "fc/heldout", options);
  EXPECT_EQ(heldout.kind, "real");
  EXPECT_EQ(heldout.images, 24);
  EXPECT_EQ(heldout.every.heldout.images, 24) << "every held-out image names a held-out combination";
  EXPECT_EQ(heldout.heldout_from, (fs::path(dir / "fc/heldout") / ".." / "config.yaml").lexically_normal().string());
  EXPECT_FALSE(heldout.fid);
  std::ifstream details(dir / "details.jsonl");
  int64_t lines = 0;
  for (std::string line; std::getline(details, line); ++lines) {
    const auto entry = nlohmann::json::parse(line);
    EXPECT_TRUE(entry.contains("measured") && entry.contains("correct") && entry.contains("prompt"));
  }
  EXPECT_EQ(lines, 24);

  options.details.clear();
  options.real = dir / "fc/test";
  const auto test = score_real(dir / "fc/test", options);
  EXPECT_EQ(test.every.seen.images, 40);
  EXPECT_EQ(test.every.heldout.images, 0);
  EXPECT_EQ(test.every.all.colour_accuracy(), 1.0) << "real colours are measured without error";
  EXPECT_EQ(test.every.all.count_accuracy(), 1.0);
  ASSERT_TRUE(test.fid);
  EXPECT_NEAR(test.fid->value, 0.0, 1e-6) << "a split against itself";
  EXPECT_GE(test.fid->value, 0.0);
  EXPECT_EQ(test.fid->generated_items, test.fid->real_items);
  EXPECT_EQ(test.fid->real_images, 40);

  // The same images as a generation folder: the same verdicts.
  fake_generation(dir / "fc/test", dir / "generated", 40);
  testing::write_text(dir / "generated/9999-00.json", R"({"prompt": "a mauve hat somewhere"})");
  fs::copy_file(dir / "generated/0000-00.png", dir / "generated/9999-00.png");
  testing::write_text(dir / "generated/eval.json", R"({"not": "a sidecar"})");
  const auto generated = score_generated(dir / "generated", options);
  EXPECT_EQ(generated.kind, "generated");
  EXPECT_EQ(generated.images, 40);
  EXPECT_EQ(generated.unparsed, 1);
  EXPECT_EQ(generated.prompts, 41);
  EXPECT_FALSE(generated.reranked);
  EXPECT_EQ(generated.every.all.correct, test.every.all.correct);
  EXPECT_EQ(generated.every.all.item, test.every.all.item);
  EXPECT_EQ(generated.best.all.correct, test.every.all.correct) << "every image has rank 0";
  ASSERT_TRUE(generated.fid);
  EXPECT_NEAR(generated.fid->value, 0.0, 1e-6);

  const auto json = nlohmann::json::parse(generated.to_json());
  EXPECT_EQ(json["accuracy"]["every_image"]["all"]["images"], 40);
  EXPECT_DOUBLE_EQ(json["accuracy"]["every_image"]["all"]["caption_accuracy"].get<double>(),
                   generated.every.all.caption_accuracy());
  EXPECT_EQ(json["skipped"]["unparsed_prompts"], 1);
  EXPECT_EQ(json["heldout_combinations"].size(), 8u);
  EXPECT_TRUE(json["fid"].is_object());
  EXPECT_EQ(generated.any.all.prompts, 40);
  EXPECT_EQ(generated.any.all.right, test.every.all.correct) << "one image per prompt: any is every";

  // Two images per prompt: at rank 0 the next prompt's picture, at rank 1 its own.
  fs::create_directories(dir / "pairs");
  for (int64_t i = 0; i < 40; ++i) {
    char own[16], next[16];
    std::snprintf(own, sizeof own, "%04lld", static_cast<long long>(i));
    std::snprintf(next, sizeof next, "%04lld", static_cast<long long>((i + 1) % 40));
    const auto prompt = nlohmann::json::parse(testing::read_text(fs::path(dir / "generated") / (std::string(own) + "-00.json")));
    fs::copy_file(fs::path(dir / "generated") / (std::string(next) + "-00.png"), fs::path(dir / "pairs") / (std::string(own) + "-00.png"));
    fs::copy_file(fs::path(dir / "generated") / (std::string(own) + "-00.png"), fs::path(dir / "pairs") / (std::string(own) + "-01.png"));
    for (int rank : {0, 1}) {
      auto sidecar = prompt;
      sidecar["rank"] = rank;
      testing::write_text(fs::path(dir / "pairs") / (std::string(own) + "-0" + std::to_string(rank) + ".json"),
                          sidecar.dump());
    }
  }
  options.details = dir / "pairs-details.jsonl";
  const auto pairs = score_generated(dir / "pairs", options);
  EXPECT_EQ(pairs.every.all.images, 80);
  EXPECT_EQ(pairs.best.all.images, 40);
  std::map<std::string, bool> any_right;
  std::ifstream pair_lines(dir / "pairs-details.jsonl");
  for (std::string line; std::getline(pair_lines, line);) {
    const auto entry = nlohmann::json::parse(line);
    any_right[entry["image"].get<std::string>().substr(0, 4)] |= entry["correct"].get<bool>();
  }
  ASSERT_EQ(any_right.size(), 40u);
  int64_t expected = 0;
  for (const auto& [prompt, right] : any_right) expected += right;
  EXPECT_EQ(pairs.any.all.prompts, 40);
  EXPECT_EQ(pairs.any.all.right, expected);
  EXPECT_GE(pairs.any.all.right, test.every.all.correct) << "each prompt's own picture is among its images";
  EXPECT_GT(pairs.any.all.right, pairs.best.all.correct) << "the wrong picture ranks first";
  EXPECT_EQ(pairs.any.seen.prompts + pairs.any.heldout.prompts, 40);
  EXPECT_EQ(nlohmann::json::parse(pairs.to_json())["accuracy"]["any_image"]["all"]["prompts"], 40);
  ASSERT_TRUE(pairs.fid);
  EXPECT_EQ(pairs.fid->generated_items, test.fid->real_items) << "FID takes the rank-0 pictures only";
  EXPECT_NEAR(pairs.fid->value, 0.0, 1e-6) << "which are the test split, reordered";
  options.details.clear();

  EXPECT_THROW_WITH(score_generated(dir / "nowhere", options), Error, "no such folder");
  fs::create_directories(dir / "empty");
  EXPECT_THROW_WITH(score_generated(dir / "empty", options), Error, "no dalle-generate sidecars");
  options.classifier = dir / "fc";
  EXPECT_THROW_WITH(score_generated(dir / "generated", options), Error, "not an item classifier directory");
}

}  // namespace
}  // namespace dalle::eval
