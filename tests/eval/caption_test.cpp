// The caption grammar read back, and the verdict of a measured picture against it.
#include "dalle/data/fashion_compose.h"
#include "dalle/eval/caption_match.h"

#include "test_support.h"

namespace dalle::eval {
namespace {

using data::CaptionObject;
using data::parse_fashion_compose_caption;

TEST(CaptionParser, ReadsBackEveryCaptionTheComposerWrites) {
  data::FashionMnist items{torch::randint(1, 255, {40, 28, 28}, torch::kInt64).to(torch::kUInt8),
                           torch::arange(40, torch::kInt64) % 10};
  data::FashionComposer composer({}, items);
  int two = 0;
  for (uint64_t seed = 0; seed < 300; ++seed) {
    std::mt19937_64 rng(seed);
    const auto composed = composer.compose(seed % 3 ? data::ComposeSplit::test : data::ComposeSplit::heldout, rng);
    const auto parsed = parse_fashion_compose_caption(composed.caption);
    ASSERT_TRUE(parsed) << composed.caption;
    ASSERT_EQ(parsed->size(), composed.objects.size()) << composed.caption;
    two += parsed->size() == 2;
    // The caption may name the two objects in either order.
    for (const auto& truth : composed.objects) {
      const bool named = std::any_of(parsed->begin(), parsed->end(), [&](const CaptionObject& o) {
        return o.colour == truth.colour && o.item == truth.item && o.label == truth.label &&
               o.position == truth.position;
      });
      EXPECT_TRUE(named) << composed.caption << ": " << truth.colour << " " << truth.item << " " << truth.position;
    }
  }
  EXPECT_GT(two, 50);
  EXPECT_LT(two, 250);
}

TEST(CaptionParser, CoversTheWholeGrammarAndForgivesCaseAndSpacing) {
  int64_t phrases = 0;
  for (const auto& colour : data::fashion_compose_colours()) {
    for (const auto& item : data::fashion_mnist_classes()) {
      for (const auto& position : data::fashion_compose_positions()) {
        const auto phrase = data::fashion_compose_phrase(colour.name, item, position);
        const auto parsed = parse_fashion_compose_caption(phrase);
        ASSERT_TRUE(parsed && parsed->size() == 1) << phrase;
        EXPECT_EQ((*parsed)[0].colour, colour.name);
        EXPECT_EQ((*parsed)[0].item, item);
        EXPECT_EQ((*parsed)[0].position, position);
        ++phrases;
      }
    }
  }
  EXPECT_EQ(phrases, 8 * 10 * 5);
  const auto parsed =
      parse_fashion_compose_caption("  An Orange  Ankle Boot at the TOP and a cyan sandal in the center. ");
  ASSERT_TRUE(parsed);
  ASSERT_EQ(parsed->size(), 2u);
  EXPECT_EQ((*parsed)[0].item, "ankle boot");
  EXPECT_EQ((*parsed)[0].label, 9);
  EXPECT_EQ((*parsed)[0].position, "top");
  EXPECT_EQ((*parsed)[1].colour, "cyan");
  EXPECT_EQ((*parsed)[1].item, "sandal");
  EXPECT_EQ((*parsed)[1].position, "center");
  EXPECT_EQ(data::fashion_compose_caption({"a red bag on the left", "a blue coat on the right"}),
            "a red bag on the left and a blue coat on the right");
}

TEST(CaptionParser, RefusesWhatTheGrammarCannotWrite) {
  for (const char* text : {"", "a red bag", "a red bag on the middle", "a pink bag on the left",
                           "a red hat on the left", "an red bag on the left", "red bag on the left",
                           "a red bag on the left and", "a red bag on the left, a blue bag on the right",
                           "a red bag at the left", "the red bag on the left"}) {
    EXPECT_FALSE(parse_fashion_compose_caption(text)) << text;
  }
}

TEST(CaptionParser, PositionCentresAreTheComposersNamedRegions) {
  EXPECT_EQ(data::fashion_compose_position_centre("left"), (std::array<double, 2>{0.25, 0.5}));
  EXPECT_EQ(data::fashion_compose_position_centre("bottom"), (std::array<double, 2>{0.5, 0.75}));
  EXPECT_THROW_WITH(data::fashion_compose_position_centre("middle"), Error, "unknown position 'middle'");
}

MeasuredObject measured(const std::string& colour, const std::string& item, const std::string& position) {
  MeasuredObject object;
  object.colour = colour;
  object.item = item;
  object.position = position;
  const auto centre = data::fashion_compose_position_centre(position);
  object.centre = {centre[0] * 64, centre[1] * 64};
  return object;
}

std::vector<CaptionObject> caption(const std::string& text) {
  auto parsed = parse_fashion_compose_caption(text);
  EXPECT_TRUE(parsed) << text;
  return parsed.value_or(std::vector<CaptionObject>{});
}

TEST(CaptionVerdict, RightWhenEveryObjectMatchesAndNothingElseIsThere) {
  const auto asked = caption("a red bag on the left and a blue sneaker on the right");
  auto verdict = judge_caption(asked, {measured("blue", "sneaker", "right"), measured("red", "bag", "left")}, 64);
  EXPECT_TRUE(verdict.correct);
  EXPECT_TRUE(verdict.count);
  ASSERT_EQ(verdict.objects.size(), 2u);
  EXPECT_TRUE(verdict.objects[0].correct() && verdict.objects[1].correct());

  // One attribute wrong spoils the caption but only that attribute.
  verdict = judge_caption(asked, {measured("red", "bag", "left"), measured("blue", "sandal", "right")}, 64);
  EXPECT_FALSE(verdict.correct);
  EXPECT_TRUE(verdict.objects[0].correct());
  EXPECT_TRUE(verdict.objects[1].colour && verdict.objects[1].position);
  EXPECT_FALSE(verdict.objects[1].item);

  // An extra item: every asked object is there, but the count is wrong.
  verdict = judge_caption(asked, {measured("red", "bag", "left"), measured("blue", "sneaker", "right"),
                                  measured("white", "coat", "center")}, 64);
  EXPECT_FALSE(verdict.correct);
  EXPECT_FALSE(verdict.count);
  EXPECT_EQ(verdict.measured, 3);
  EXPECT_TRUE(verdict.objects[0].correct() && verdict.objects[1].correct());
}

TEST(CaptionVerdict, SwappedItemsGetTheirColoursAndItemsButNotPositions) {
  const auto asked = caption("a red bag on the left and a blue sneaker on the right");
  const auto verdict = judge_caption(asked, {measured("red", "bag", "right"), measured("blue", "sneaker", "left")}, 64);
  EXPECT_FALSE(verdict.correct);
  for (const auto& object : verdict.objects) {
    EXPECT_TRUE(object.found && object.colour && object.item);
    EXPECT_FALSE(object.position);
  }
}

TEST(CaptionVerdict, MissingItemsAreNotFound) {
  const auto asked = caption("a red bag on the left and a blue sneaker on the right");
  auto verdict = judge_caption(asked, {measured("blue", "sneaker", "right")}, 64);
  EXPECT_FALSE(verdict.correct);
  EXPECT_FALSE(verdict.count);
  EXPECT_FALSE(verdict.objects[0].found);
  EXPECT_TRUE(verdict.objects[1].correct());
  verdict = judge_caption(asked, {}, 64);
  EXPECT_FALSE(verdict.objects[0].found || verdict.objects[1].found);

  AccuracyTally tally;
  tally.add(verdict);
  tally.add(judge_caption(caption("a white coat in the center"), {measured("white", "coat", "center")}, 64));
  EXPECT_EQ(tally.images, 2);
  EXPECT_EQ(tally.objects, 3);
  EXPECT_DOUBLE_EQ(tally.caption_accuracy(), 0.5);
  EXPECT_DOUBLE_EQ(tally.colour_accuracy(), 1.0 / 3);
  EXPECT_DOUBLE_EQ(tally.count_accuracy(), 0.5);
  EXPECT_DOUBLE_EQ(AccuracyTally{}.caption_accuracy(), 0.0);
}

// Pictures judged from their pixels, the classifier's part stood in for: every object found
// is named the caption's first item, so what is found decides.
void paint(torch::Tensor& image, int64_t x0, int64_t y0, int64_t x1, int64_t y1, std::array<float, 3> rgb) {
  for (int c = 0; c < 3; ++c) image[c].slice(0, y0, y1).slice(1, x0, x1).fill_(rgb[c]);
}

CaptionVerdict judge_picture(const torch::Tensor& image, const std::string& text, bool lenient) {
  const auto asked = caption(text);
  MeasureOptions options;
  options.lenient = lenient;
  auto objects = find_objects(image, options);
  for (auto& object : objects) object.item = asked.at(0).item;
  return judge_caption(asked, objects, 64);
}

const std::array<float, 3> kRed = {0.9f, 0.12f, 0.12f};

TEST(CaptionVerdict, AnItemInDetachedPiecesIsWrongUnlessLenient) {
  // Two pieces 6 pixels apart whose joint box fits one item, like the demo's cyan sandals.
  auto image = torch::zeros({3, 64, 64});
  paint(image, 38, 24, 46, 40, kRed);
  paint(image, 52, 28, 58, 40, kRed);
  auto verdict = judge_picture(image, "a red sandal on the right", false);
  EXPECT_EQ(verdict.measured, 2);
  EXPECT_FALSE(verdict.count);
  EXPECT_FALSE(verdict.correct);
  EXPECT_TRUE(verdict.objects[0].correct()) << "the larger piece alone looks right";
  verdict = judge_picture(image, "a red sandal on the right", true);
  EXPECT_EQ(verdict.measured, 1);
  EXPECT_TRUE(verdict.correct);
}

TEST(CaptionVerdict, AStrayBlobMakesACaptionWrongUnlessLenient) {
  auto image = torch::zeros({3, 64, 64});
  paint(image, 36, 22, 58, 42, kRed);
  EXPECT_TRUE(judge_picture(image, "a red sandal on the right", false).correct);
  paint(image, 6, 40, 7, 41, kRed);  // a lone pixel is noise under either judgement
  EXPECT_TRUE(judge_picture(image, "a red sandal on the right", false).correct);
  paint(image, 30, 4, 32, 6, kRed);  // a stray 2x2 blob at the top
  const auto verdict = judge_picture(image, "a red sandal on the right", false);
  EXPECT_EQ(verdict.measured, 2);
  EXPECT_FALSE(verdict.correct);
  EXPECT_TRUE(judge_picture(image, "a red sandal on the right", true).correct);
}

TEST(CaptionVerdict, AnExtraItemMakesACaptionWrongUnderEitherJudgement) {
  auto image = torch::zeros({3, 64, 64});
  paint(image, 36, 22, 58, 42, kRed);
  paint(image, 6, 22, 26, 42, {0.15f, 0.3f, 0.95f});  // a blue item on the left, not asked for
  for (const bool lenient : {false, true}) {
    const auto verdict = judge_picture(image, "a red sandal on the right", lenient);
    EXPECT_EQ(verdict.measured, 2) << lenient;
    EXPECT_FALSE(verdict.count);
    EXPECT_FALSE(verdict.correct);
    EXPECT_TRUE(verdict.objects[0].correct());
  }
}

TEST(CaptionVerdict, HeldOutWhenAnyColourItemPairIsInTheList) {
  const std::vector<std::string> heldout = {"red sneaker", "blue bag"};
  EXPECT_TRUE(names_heldout_combination(caption("a red sneaker on the left"), heldout));
  EXPECT_TRUE(names_heldout_combination(caption("a white coat at the top and a blue bag at the bottom"), heldout));
  EXPECT_FALSE(names_heldout_combination(caption("a red bag on the left and a blue sneaker on the right"), heldout));
}

}  // namespace
}  // namespace dalle::eval
