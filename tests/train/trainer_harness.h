#pragma once
// What every trainer's tests share: its metrics lines, and the exact-resume check that a run
// stopped, cut back to an earlier checkpoint and resumed ends exactly as a run never stopped.
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "dalle/io/checkpoint.h"
#include "test_support.h"

namespace dalle::testing {

// update -> the metrics line of each update that logged a training loss; an update logged
// twice fails the test.
inline std::map<int64_t, nlohmann::json> training_lines(const std::string& run) {
  std::map<int64_t, nlohmann::json> out;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto entry = nlohmann::json::parse(line);
    if (!entry.contains("loss")) continue;
    const bool first = out.emplace(entry["step"].get<int64_t>(), entry).second;
    EXPECT_TRUE(first) << "update " << entry["step"] << " logged twice in " << run;
  }
  return out;
}

// Trains `config` (which checkpoints every 3 updates and logs every update) for 8 updates
// whole, and for 4 then resumed from the checkpoint at update 3. Every update's metrics line
// and the last checkpoint's tensors (weights, moving average, moments, generators, scales)
// must agree bit for bit. The two runs are `runs`/whole and `runs`/interrupted.
template <class Trainer, class Config>
void expect_exact_resume(const Config& config, const ScratchDir& runs = ScratchDir()) {
  auto whole = config, half = config;
  whole.steps = 8;
  half.steps = 4;
  EXPECT_EQ(config.checkpoint_every, 3);
  EXPECT_EQ(config.log_every, 1);
  Trainer(whole, runs / "whole").run();
  Trainer(half, runs / "interrupted").run();  // checkpoints at 3 and 4
  std::filesystem::remove_all(runs / "interrupted/checkpoints/step-000000004");
  write_text(runs / "interrupted/checkpoints/latest", "step-000000003\n");
  Trainer resumed(whole, runs / "interrupted");
  EXPECT_EQ(resumed.step(), 3);
  resumed.run();

  const auto lines = training_lines(runs / "whole");
  EXPECT_EQ(lines.size(), 8u);
  EXPECT_EQ(training_lines(runs / "interrupted"), lines) << "every update's metrics, bit for bit, none twice";
  const auto a = io::load_checkpoint(runs / "whole/checkpoints/step-000000008");
  const auto b = io::load_checkpoint(runs / "interrupted/checkpoints/step-000000008");
  for (const auto& [name, tensor] : a.weights) EXPECT_TRUE(torch::equal(tensor, b.weights.at(name))) << name;
  EXPECT_EQ(a.state.size(), b.state.size());
  for (const auto& [name, tensor] : a.state) {
    const auto other = b.state.find(name);
    EXPECT_TRUE(other != b.state.end() && torch::equal(tensor, other->second)) << name;
  }
}

}  // namespace dalle::testing
