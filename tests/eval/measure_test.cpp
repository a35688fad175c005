// Colour and position measured from the pixels, on synthetic pictures and on real
// fashion-compose images against their ground truth. (The item needs the trained
// classifier: classifier_test.cpp.)
#include "dalle/eval/object_measure.h"

#include "dalle/data/fashion_compose.h"
#include "dalle/data/image.h"
#include "dalle/data/sampler.h"
#include "dalle/eval/caption_match.h"
#include "test_support.h"

namespace dalle::eval {
namespace {

torch::Tensor canvas() { return torch::zeros({3, 64, 64}); }

void paint(torch::Tensor& image, int64_t x0, int64_t y0, int64_t x1, int64_t y1, std::array<float, 3> rgb) {
  for (int c = 0; c < 3; ++c) image[c].slice(0, y0, y1).slice(1, x0, x1).fill_(rgb[c]);
}

TEST(Measure, NamesEveryColourWhateverItsBrightness) {
  for (const auto& named : data::fashion_compose_colours()) {
    for (float scale : {0.25f, 0.6f, 1.0f}) {
      EXPECT_EQ(nearest_colour({named.rgb[0] * scale, named.rgb[1] * scale, named.rgb[2] * scale}), named.name)
          << named.name << " x " << scale;
    }
  }
  EXPECT_EQ(nearest_colour({0.5f, 0.5f, 0.48f}), "white");
  EXPECT_EQ(nearest_colour({0.2f, 0.9f, 0.3f}), "green");
}

TEST(Measure, NamesThePositionNearestTheCentre) {
  EXPECT_EQ(nearest_position(16, 32, 64), "left");
  EXPECT_EQ(nearest_position(47, 30, 64), "right");
  EXPECT_EQ(nearest_position(32, 14, 64), "top");
  EXPECT_EQ(nearest_position(30, 50, 64), "bottom");
  EXPECT_EQ(nearest_position(33, 33, 64), "center");
  EXPECT_EQ(nearest_position(64, 128, 256), "left");
}

TEST(Measure, FindsPaintedItemsAndIgnoresLonePixels) {
  EXPECT_TRUE(find_objects(canvas()).empty());
  auto image = canvas();
  paint(image, 6, 20, 26, 44, {0.9f, 0.12f, 0.12f});   // red, left
  paint(image, 40, 22, 56, 40, {0.15f, 0.3f, 0.95f});  // blue, right
  // The same picture at 256 pixels measures the same.
  const auto large = find_objects(data::resize(image, 256, 256));
  ASSERT_EQ(large.size(), 2u);
  EXPECT_EQ(large[0].colour, "red");
  EXPECT_EQ(large[0].position, "left");
  EXPECT_EQ(large[1].colour, "blue");
  EXPECT_EQ(large[1].position, "right");

  paint(image, 30, 58, 31, 59, {1.0f, 1.0f, 1.0f});    // a lone pixel
  const auto objects = find_objects(image);
  ASSERT_EQ(objects.size(), 2u);
  EXPECT_EQ(objects[0].colour, "red");
  EXPECT_EQ(objects[0].position, "left");
  EXPECT_EQ(objects[0].box, (std::array<int64_t, 4>{6, 20, 26, 44}));
  EXPECT_EQ(objects[0].pixels, 20 * 24);
  EXPECT_EQ(objects[1].colour, "blue");
  EXPECT_EQ(objects[1].position, "right");
  ASSERT_EQ(objects[0].crop.sizes(), (std::vector<int64_t>{1, 28, 28}));
  EXPECT_FLOAT_EQ(objects[0].crop.max().item<float>(), 1.0f);
}

TEST(Measure, SplitsTouchingItemsAndJoinsFragments) {
  auto image = canvas();
  paint(image, 4, 20, 31, 44, {0.1f, 0.72f, 0.2f});   // green, left ...
  paint(image, 31, 30, 33, 32, {0.1f, 0.72f, 0.2f});  // ... a faint bridge to ...
  paint(image, 33, 18, 60, 46, {0.98f, 0.55f, 0.05f});  // ... an orange item on the right
  auto objects = find_objects(image);
  ASSERT_EQ(objects.size(), 2u);
  std::sort(objects.begin(), objects.end(), [](const auto& a, const auto& b) { return a.centre[0] < b.centre[0]; });
  EXPECT_EQ(objects[0].position, "left");
  EXPECT_EQ(objects[0].colour, "green");
  EXPECT_EQ(objects[1].position, "right");
  EXPECT_EQ(objects[1].colour, "orange");

  // A sandal-like item in three pieces, 4 and 5 pixels apart (its straps): one object at
  // the top under either judgement.
  image = canvas();
  paint(image, 20, 8, 28, 20, {0.6f, 0.2f, 0.82f});
  paint(image, 32, 8, 38, 14, {0.6f, 0.2f, 0.82f});
  paint(image, 32, 19, 44, 24, {0.6f, 0.2f, 0.82f});
  MeasureOptions lenient;
  lenient.lenient = true;
  for (const auto& options : {MeasureOptions{}, lenient}) {
    objects = find_objects(image, options);
    ASSERT_EQ(objects.size(), 1u) << judgement_name(options);
    EXPECT_EQ(objects[0].colour, "purple");
    EXPECT_EQ(objects[0].position, "top");
    EXPECT_EQ(objects[0].box, (std::array<int64_t, 4>{20, 8, 44, 24}));
  }
}

// Two pieces with `gap` background columns between them, together well within one item's box.
torch::Tensor two_pieces(int64_t gap) {
  auto image = canvas();
  paint(image, 36, 24, 44, 40, {0.9f, 0.12f, 0.12f});
  paint(image, 44 + gap, 28, 50 + gap, 40, {0.9f, 0.12f, 0.12f});
  return image;
}

TEST(Measure, DetachedPiecesAreSeparateObjectsUnlessLenient) {
  const MeasureOptions strict;
  MeasureOptions lenient;
  lenient.lenient = true;
  EXPECT_EQ(judgement_name(strict), "strict");
  EXPECT_EQ(judgement_name(lenient), "lenient");
  // Up to join_gap pixels apart the pieces are one object, one pixel more and they are two.
  EXPECT_EQ(find_objects(two_pieces(strict.join_gap), strict).size(), 1u);
  const auto pieces = find_objects(two_pieces(strict.join_gap + 1), strict);
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].box, (std::array<int64_t, 4>{36, 24, 44, 40}));
  EXPECT_EQ(pieces[1].pixels, 6 * 12);
  // The lenient judgement joins them, since together they fit one item; so it does 8 pixels apart.
  for (const int64_t gap : {strict.join_gap + 1, int64_t{8}}) {
    const auto joined = find_objects(two_pieces(gap), lenient);
    ASSERT_EQ(joined.size(), 1u) << gap;
    EXPECT_EQ(joined[0].pixels, 8 * 16 + 6 * 12);
    EXPECT_EQ(joined[0].position, "right");
  }
}

// Two pieces 6 columns apart joined by a bridge of dim pixels two rows high (0.12 against
// their 0.9, as a decoder draws the demo grid's faint joints): a person sees two pieces. Above
// the threshold, the bridge joins them into one component; the bridge cut separates them,
// the pixels between going to the nearer piece. The lenient judgement cuts nothing.
TEST(Measure, AFaintBridgeIsCutBetweenTwoPieces) {
  auto image = two_pieces(6);
  paint(image, 44, 33, 50, 35, {0.12f, 0.03f, 0.03f});
  const MeasureOptions strict;
  EXPECT_EQ(item_bridge_contrast(strict), 0.3);
  const auto cut = find_objects(image, strict);
  ASSERT_EQ(cut.size(), 2u);
  EXPECT_EQ(cut[0].pixels + cut[1].pixels, 8 * 16 + 6 * 12 + 6 * 2);
  EXPECT_EQ(cut[0].box, (std::array<int64_t, 4>{36, 24, 47, 40}));
  MeasureOptions uncut = strict;
  uncut.bridge_contrast = 0;
  ASSERT_EQ(find_objects(image, uncut).size(), 1u);
  MeasureOptions lenient = strict;
  lenient.lenient = true;
  lenient.threshold = 0.15;
  EXPECT_EQ(item_threshold(lenient), 0.1);
  EXPECT_EQ(item_bridge_contrast(lenient), 0);
  const auto joined = find_objects(image, lenient);
  ASSERT_EQ(joined.size(), 1u);
  EXPECT_EQ(joined[0].pixels, 8 * 16 + 6 * 12 + 6 * 2);
}

// A dark band across an item (a stripe) as dim as that bridge but wider than the item's edge
// has an inside, so the two bright halves stay one object; so do a dim handle's specks.
TEST(Measure, ADarkBandOrAFaintHandleKeepsAnItemWhole) {
  auto image = canvas();
  paint(image, 20, 10, 40, 20, {0.9f, 0.9f, 0.1f});
  paint(image, 20, 20, 40, 26, {0.12f, 0.12f, 0.01f});
  paint(image, 20, 26, 40, 36, {0.9f, 0.9f, 0.1f});
  auto objects = find_objects(image);
  ASSERT_EQ(objects.size(), 1u);
  EXPECT_EQ(objects[0].pixels, 20 * 26);

  image = canvas();
  paint(image, 20, 20, 40, 36, {0.9f, 0.9f, 0.1f});  // a bag ...
  paint(image, 27, 17, 33, 18, {0.12f, 0.12f, 0.01f});  // ... with a faint handle ...
  paint(image, 29, 16, 31, 17, {0.9f, 0.9f, 0.1f});     // ... lit in two bright pixels
  objects = find_objects(image);
  ASSERT_EQ(objects.size(), 1u);
  EXPECT_EQ(objects[0].pixels, 20 * 16 + 6 + 2);
}

TEST(Measure, AStrayBlobIsAnObjectUnlessLenient) {
  auto image = canvas();
  paint(image, 36, 22, 58, 42, {0.9f, 0.12f, 0.12f});  // a red item on the right
  paint(image, 6, 30, 8, 32, {0.9f, 0.12f, 0.12f});    // a stray 2x2 blob on the left
  const auto objects = find_objects(image);
  ASSERT_EQ(objects.size(), 2u);
  EXPECT_EQ(objects[1].pixels, 4);
  EXPECT_EQ(objects[1].position, "left");
  MeasureOptions lenient;
  lenient.lenient = true;
  EXPECT_EQ(find_objects(image, lenient).size(), 1u);
}

// Real fashion-compose images: what the measurement finds against the saved ground truth.
TEST(Measure, AgreesWithTheGroundTruthOfRealImages) {
  data::FashionComposer composer({}, data::load_fashion_mnist("test"));
  AccuracyTally tally;
  int64_t heldout = 0;
  const int64_t images = 400;
  for (int64_t i = 0; i < images; ++i) {
    std::mt19937_64 rng(mix_seed(99, static_cast<uint64_t>(i)));
    const auto split = i % 4 == 0 ? data::ComposeSplit::heldout : data::ComposeSplit::test;
    heldout += split == data::ComposeSplit::heldout;
    // Through an 8-bit PNG, as the dataset stores it.
    const auto composed = composer.compose(split, rng);
    const auto image = data::decode_image(data::encode_png(composed.image), "composed");
    std::vector<data::CaptionObject> truth;
    for (const auto& o : composed.objects) truth.push_back({o.colour, o.item, o.label, o.position});
    // No classifier here: the items stay unnamed and only colour, position and count count.
    tally.add(judge_caption(truth, find_objects(image), 64));
  }
  const double both = static_cast<double>(tally.colour + tally.position) / (2.0 * tally.objects);
  std::cout << "[ measured ] " << images << " real images (" << heldout << " held out), " << tally.objects
            << " objects: count " << tally.count_accuracy() << ", colour " << tally.colour_accuracy()
            << ", position " << tally.position_accuracy() << "\n";
  // Strict as the judgement is, real items are seldom counted in pieces (the bridge cut
  // splits one of these 400).
  EXPECT_GE(tally.count_accuracy(), 0.99);
  EXPECT_GE(tally.colour_accuracy(), 0.97);
  EXPECT_GE(tally.position_accuracy(), 0.97);
  EXPECT_GE(both, 0.97);
}

}  // namespace
}  // namespace dalle::eval
