#include "train/metrics_line.h"

#include <vector>

namespace dalle::train {

void average_over_job(nlohmann::json& line, distributed::Job& job) {
  std::vector<double> values;
  for (const auto& item : line.items()) {
    if (item.value().is_number_float()) values.push_back(item.value().get<double>());
  }
  job.average(values);
  auto next = values.begin();
  for (auto& item : line.items()) {
    if (item.value().is_number_float()) item.value() = *next++;
  }
}

void add_scale_metrics(nlohmann::json& line, const ModelPrecision& precision) {
  const auto* scaler = precision.scaler();
  if (!scaler) return;
  if (precision.scales_loss()) {
    line["grad_scale"] = scaler->scale(0);
  } else {
    const auto scales = scaler->summary();
    line.update({{"grad_scale_min", scales.min}, {"grad_scale_median", scales.median}, {"grad_scale_max", scales.max}});
  }
  line["skipped_updates"] = scaler->skipped_updates();
}

}  // namespace dalle::train
