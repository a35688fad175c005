#include "dalle/eval/caption_match.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

namespace dalle::eval {

CaptionVerdict judge_caption(const std::vector<data::CaptionObject>& caption,
                             const std::vector<MeasuredObject>& measured, int64_t canvas_size) {
  const size_t wanted = caption.size();
  // The search is exhaustive, so it looks at the largest few objects only (they come
  // largest first); captions name one or two.
  const size_t have = std::min(measured.size(), std::max<size_t>(wanted, 6));
  auto agreement = [&](size_t c, size_t m) {
    return int(caption[c].colour == measured[m].colour) + int(caption[c].item == measured[m].item) +
           int(caption[c].position == measured[m].position);
  };
  auto distance = [&](size_t c, size_t m) {
    const auto centre = data::fashion_compose_position_centre(caption[c].position);
    return std::hypot(measured[m].centre[0] / canvas_size - centre[0], measured[m].centre[1] / canvas_size - centre[1]);
  };
  std::vector<int64_t> current(wanted, -1), best(wanted, -1);
  std::vector<bool> used(have, false);
  int best_agreement = -1;
  double best_distance = std::numeric_limits<double>::infinity();
  // Exactly min(wanted, have) caption objects get a partner: the rest stay unpaired.
  const size_t may_skip = wanted > have ? wanted - have : 0;
  std::function<void(size_t, size_t, int, double)> search = [&](size_t c, size_t skipped, int agree, double far) {
    if (c == wanted) {
      if (agree > best_agreement || (agree == best_agreement && far < best_distance)) {
        best_agreement = agree, best_distance = far, best = current;
      }
      return;
    }
    for (size_t m = 0; m < have; ++m) {
      if (used[m]) continue;
      used[m] = true, current[c] = static_cast<int64_t>(m);
      search(c + 1, skipped, agree + agreement(c, m), far + distance(c, m));
      used[m] = false, current[c] = -1;
    }
    if (skipped < may_skip) search(c + 1, skipped + 1, agree, far);
  };
  search(0, 0, 0, 0.0);

  CaptionVerdict verdict;
  verdict.measured = static_cast<int64_t>(measured.size());
  verdict.count = measured.size() == wanted;
  for (size_t c = 0; c < wanted; ++c) {
    ObjectVerdict object;
    if (best[c] >= 0) {
      const auto& m = measured[static_cast<size_t>(best[c])];
      object.found = true;
      object.colour = m.colour == caption[c].colour;
      object.item = m.item == caption[c].item;
      object.position = m.position == caption[c].position;
    }
    verdict.objects.push_back(object);
  }
  verdict.correct = verdict.count && !caption.empty() &&
                    std::all_of(verdict.objects.begin(), verdict.objects.end(),
                                [](const ObjectVerdict& o) { return o.correct(); });
  return verdict;
}

void AccuracyTally::add(const CaptionVerdict& verdict) {
  ++images;
  correct += verdict.correct;
  count += verdict.count;
  for (const auto& object : verdict.objects) {
    ++objects;
    found += object.found;
    colour += object.colour;
    item += object.item;
    position += object.position;
  }
}

namespace {
double fraction(int64_t part, int64_t whole) { return whole == 0 ? 0.0 : static_cast<double>(part) / whole; }
}  // namespace

double AccuracyTally::caption_accuracy() const { return fraction(correct, images); }
double AccuracyTally::count_accuracy() const { return fraction(count, images); }
double AccuracyTally::colour_accuracy() const { return fraction(colour, objects); }
double AccuracyTally::item_accuracy() const { return fraction(item, objects); }
double AccuracyTally::position_accuracy() const { return fraction(position, objects); }

bool names_heldout_combination(const std::vector<data::CaptionObject>& caption,
                               const std::vector<std::string>& heldout) {
  return std::any_of(caption.begin(), caption.end(), [&](const data::CaptionObject& object) {
    return std::find(heldout.begin(), heldout.end(), object.colour + " " + object.item) != heldout.end();
  });
}

}  // namespace dalle::eval
