#pragma once
// What every trainer's metrics line holds beyond its own values (TrainerState::append_metrics).
// Private to the library.
#include <nlohmann/json.hpp>

#include "dalle/distributed/job.h"
#include "dalle/train/model_precision.h"

namespace dalle::train {

// Every rank of `job` calls it after the same update: the line's fractional values (losses,
// ...) become their mean over the ranks.
void average_over_job(nlohmann::json& line, distributed::Job& job);
// The fp16 scales: the one scale, or the spread of the per-resblock ones, and the updates
// skipped so far; nothing outside fp16.
void add_scale_metrics(nlohmann::json& line, const ModelPrecision& precision);

}  // namespace dalle::train
