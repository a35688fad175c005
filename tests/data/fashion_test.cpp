#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <zlib.h>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/fashion_compose.h"
#include "dalle/data/fashion_mnist.h"
#include "test_support.h"

namespace dalle::data {
namespace {

using testing::ScratchDir;

const FashionMnist& test_items() {
  static const FashionMnist items = load_fashion_mnist("test");
  return items;
}

TEST(FashionMnist, LoadsTheDebianPackage) {
  const auto& items = test_items();
  EXPECT_EQ(items.images.sizes(), (std::vector<int64_t>{10000, 28, 28}));
  EXPECT_EQ(items.labels.sizes(), (std::vector<int64_t>{10000}));
  EXPECT_EQ(torch::bincount(items.labels).min().item<int64_t>(), 1000) << "1000 test items per class";
  EXPECT_EQ(load_fashion_mnist("train").images.size(0), 60000);
  EXPECT_THROW_WITH(load_fashion_mnist("validation"), Error, "unknown Fashion-MNIST split");
  EXPECT_THROW_WITH(load_fashion_mnist("test", "/nonexistent"), Error, "dataset-fashion-mnist");
}

TEST(FashionMnist, IdxReaderValidatesHeaderAndSize) {
  ScratchDir dir;
  const std::string good = std::string("\0\0\x08\x02\0\0\0\x02\0\0\0\x03", 12) + "abcdef";
  testing::write_text(dir / "good.idx", good);
  const auto tensor = read_idx(dir / "good.idx");
  EXPECT_EQ(tensor.sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(tensor[1][2].item<uint8_t>(), 'f');
  gzFile gz = gzopen((dir / "good.idx.gz").c_str(), "wb");
  gzwrite(gz, good.data(), static_cast<unsigned>(good.size()));
  gzclose(gz);
  EXPECT_TRUE(torch::equal(read_idx(dir / "good.idx.gz"), tensor));

  testing::write_text(dir / "short.idx", good.substr(0, good.size() - 1));
  EXPECT_THROW_WITH(read_idx(dir / "short.idx"), Error, "holds 5 bytes, its header promises 6");
  testing::write_text(dir / "magic.idx", "\x01\x02\x03\x04");
  EXPECT_THROW_WITH(read_idx(dir / "magic.idx"), Error, "bad magic number");
}

TEST(FashionMnist, ImportWritesImagesAndTemplatedCaptions) {
  ScratchDir dir;
  FashionMnistImportOptions options;
  options.split = "test";
  options.limit = 5;
  options.templates = {"{a_item}", "a photo of the {item}"};
  EXPECT_EQ(import_fashion_mnist(dir / "out", options), 5);
  const auto dataset = ImageCaptionDataset::open(dir / "out");
  ASSERT_EQ(dataset->size(), 5u);
  // The first test item is an ankle boot (label 9).
  EXPECT_EQ(dataset->record(0).captions,
            (std::vector<std::string>{"an ankle boot", "a photo of the ankle boot"}));
  std::mt19937_64 rng(0);
  const auto example = dataset->get(0, rng);
  ASSERT_TRUE(example.has_value());
  EXPECT_TRUE(torch::allclose(example->image[0], test_items().images[0].to(torch::kFloat32) / 255.0, 0, 1e-6));
}

class FashionComposeTest : public ::testing::Test {
 protected:
  FashionComposeConfig config_;
};

TEST_F(FashionComposeTest, TrainingNeverShowsAHeldOutCombination) {
  FashionComposer composer(config_, test_items());
  std::mt19937_64 rng(1);
  int heldout_seen = 0;
  for (int i = 0; i < 1500; ++i) {
    for (const auto& object : composer.compose(ComposeSplit::train, rng).objects) {
      EXPECT_FALSE(composer.is_heldout(object.colour, object.label)) << object.colour << " " << object.item;
    }
  }
  for (int i = 0; i < 300; ++i) {
    const auto composed = composer.compose(ComposeSplit::heldout, rng);
    const auto& first = composed.objects.front();
    heldout_seen += composer.is_heldout(first.colour, first.label);
  }
  EXPECT_EQ(heldout_seen, 300) << "every heldout image shows a held-out combination";
}

TEST_F(FashionComposeTest, CaptionsDescribeWhatIsDrawn) {
  FashionComposer composer(config_, test_items());
  std::mt19937_64 rng(2);
  int two_items = 0;
  for (int i = 0; i < 400; ++i) {
    const auto composed = composer.compose(ComposeSplit::test, rng);
    two_items += composed.objects.size() == 2;
    for (const auto& object : composed.objects) {
      const std::string phrase = object.colour + " " + object.item;
      EXPECT_THAT(composed.caption, ::testing::HasSubstr(phrase));
      EXPECT_THAT(composed.caption, ::testing::HasSubstr(object.position));
      const auto [x0, y0, x1, y1] = object.box;
      ASSERT_LT(x0, x1);
      ASSERT_LT(y0, y1);
      EXPECT_GE(x0, 0);
      EXPECT_LE(x1, 64);
      const double cx = (x0 + x1) / 2.0, cy = (y0 + y1) / 2.0;
      if (object.position == "left") {
        EXPECT_LT(cx, 32);
      }
      if (object.position == "right") {
        EXPECT_GT(cx, 32);
      }
      if (object.position == "top") {
        EXPECT_LT(cy, 32);
      }
      if (object.position == "bottom") {
        EXPECT_GT(cy, 32);
      }
      // The box's pixels carry the named colour: its dominant channel matches.
      const auto& rgb = std::find_if(fashion_compose_colours().begin(), fashion_compose_colours().end(),
                                     [&](const auto& c) { return c.name == object.colour; })->rgb;
      auto pixels = composed.image.slice(1, y0, y1).slice(2, x0, x1).reshape({3, -1});
      auto bright = pixels.index({torch::indexing::Slice(), pixels.sum(0) > 0.6});
      if (bright.size(1) == 0) continue;
      auto mean = bright.mean(1);
      auto expected = torch::tensor({rgb[0], rgb[1], rgb[2]});
      EXPECT_GT(torch::cosine_similarity(mean, expected, 0).item<float>(), 0.97f) << phrase;
    }
  }
  EXPECT_GT(two_items, 120);
  EXPECT_LT(two_items, 280);
}

TEST_F(FashionComposeTest, SameSeedSameImages) {
  FashionComposer composer(config_, test_items());
  std::mt19937_64 a(11), b(11);
  const auto x = composer.compose(ComposeSplit::train, a);
  const auto y = composer.compose(ComposeSplit::train, b);
  EXPECT_EQ(x.caption, y.caption);
  EXPECT_TRUE(torch::equal(x.image, y.image));
}

TEST_F(FashionComposeTest, BadHeldOutEntriesAreRefused) {
  config_.heldout = {"red sneaker", "magenta bag"};
  EXPECT_THROW_WITH(FashionComposer(config_, test_items()), Error, "'magenta bag'");
  config_.heldout = {"red"};
  EXPECT_THROW_WITH(FashionComposer(config_, test_items()), Error, "'red'");
  config_.heldout = {};
  config_.item_size = 40;
  EXPECT_THROW_WITH(FashionComposer(config_, test_items()), Error, "at most half the canvas");
}

TEST_F(FashionComposeTest, BuildWritesSplitsGroundTruthConfigAndGrid) {
  ScratchDir dir;
  config_.train_images = 40;
  config_.test_images = 10;
  config_.heldout_images = 10;
  build_fashion_compose(config_, dir / "fc");
  for (const char* split : {"train", "test", "heldout"}) {
    const auto dataset = ImageCaptionDataset::open(dir / ("fc/" + std::string(split)));
    EXPECT_EQ(dataset->size(), std::string(split) == "train" ? 40u : 10u);
  }
  std::ifstream lines(dir / "fc/heldout/captions.jsonl");
  std::string line;
  std::getline(lines, line);
  const auto entry = nlohmann::json::parse(line);
  EXPECT_TRUE(entry.contains("objects"));
  EXPECT_EQ(entry["objects"][0]["box"].size(), 4u);
  EXPECT_TRUE(std::filesystem::exists(dir / "fc/sample_grid.png"));
  const auto saved = load_config<FashionComposeConfig>(ConfigSource::from_file(dir / "fc/config.yaml"));
  EXPECT_EQ(saved.train_images, 40);
  EXPECT_EQ(saved.heldout, config_.heldout);

  // Rebuilding with the same seed gives byte-identical images.
  build_fashion_compose(config_, dir / "again");
  EXPECT_EQ(testing::read_text(dir / "fc/train/images/000007.png"),
            testing::read_text(dir / "again/train/images/000007.png"));
}

}  // namespace
}  // namespace dalle::data
