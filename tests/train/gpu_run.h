#pragma once
// The checks every trainer with a `device` shares: a GPU run follows the CPU run of the same
// config and resumes there (only where torch sees a CUDA device), and a CUDA device asked for
// where there is none is refused before the run folder is made (only where there is none).
#include <torch/cuda.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "dalle/error.h"
#include "test_support.h"

namespace dalle::testing {

// Update -> the value of `key` in the metrics lines that carry it.
inline std::map<int64_t, double> logged(const std::string& run, const std::string& key) {
  std::map<int64_t, double> values;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto entry = nlohmann::json::parse(line);
    if (entry.contains(key)) values[entry["step"].get<int64_t>()] = entry[key].get<double>();
  }
  return values;
}

// Trains `config` (log_every 1) on the CPU and on the GPU, then resumes both for three more
// updates. Both start from the same weights (built on the CPU, then moved) and batches, so
// with `tolerance` the GPU's `key` stays within it (relative) of the CPU's at every update:
// TF32 and other kernels differ, the data do not. Trainers whose noise comes from the
// device's own generator pass no tolerance and are held to finite values only.
template <class Trainer, class Config>
void expect_gpu_run_follows_cpu_run(Config config, const std::string& key, std::optional<double> tolerance) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "torch sees no CUDA device";
  ScratchDir runs;
  const int64_t first_steps = config.run.steps;
  for (const int64_t steps : {first_steps, first_steps + 3}) {
    config.run.steps = steps;
    for (const char* device : {"cpu", "cuda"}) {
      config.run.device = device;
      Trainer trainer(config, runs / device);
      EXPECT_EQ(trainer.step(), steps == first_steps ? 0 : first_steps) << device;
      trainer.run();
    }
  }
  const auto cpu = logged(runs / "cpu", key), gpu = logged(runs / "cuda", key);
  ASSERT_EQ(cpu.size(), static_cast<size_t>(first_steps + 3));
  ASSERT_EQ(gpu.size(), cpu.size());
  for (const auto& [step, expected] : cpu) {
    const double value = gpu.at(step);
    EXPECT_TRUE(std::isfinite(value)) << "update " << step;
    if (tolerance) {
      EXPECT_NEAR(value, expected, *tolerance * std::abs(expected)) << "update " << step;
    }
  }
}

// `what` is how the trainer names itself in the error ("prior training").
template <class Trainer, class Config>
void expect_cuda_refused_without_a_gpu(Config config, const std::string& what) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "torch sees a CUDA device";
  ScratchDir runs;
  config.run.device = "cuda";
  EXPECT_THROW_WITH(Trainer(config, runs / "run"), Error,
                    what + ": device cuda was asked for, but torch sees no CUDA device");
  EXPECT_FALSE(std::filesystem::exists(runs / "run"));
}

}  // namespace dalle::testing
