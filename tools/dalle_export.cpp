// dalle-export: a trained run's weights for inference only (the EMA, config.yaml, no
// optimizer state), for shipping or for dalle-generate.
#include "dalle/error.h"
#include "dalle/log.h"
#include "dalle/models/export_weights.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  CLI::App app{"Writes the inference weights of a trained run (its latest checkpoint's moving average) as a "
               "checkpoint directory without optimizer state."};
  app.name("dalle-export");
  tools::add_common_options(app);
  std::string run, out;
  std::vector<std::string> overrides;
  int64_t average = 1;
  bool adapter_only = false;
  app.add_option("run", run, "run directory (its latest checkpoint) or checkpoint directory")->required();
  app.add_option("--out", out, "checkpoint directory to write (replaced only if it is an earlier export)")->required();
  app.add_option("--set", overrides,
                 "key.path=value: rewrite a key of the exported config.yaml, such as a prior's `tokenizer` "
                 "and `image_tokenizer` paths once shipped beside it (repeatable; the key must exist and keep its kind: a number, a flag, a list, text)");
  app.add_option("--average", average,
                 "write the mean of the weights of the run's N newest checkpoints (1: the newest alone); its config is "
                 "the newest's")
      ->check(CLI::Range(1, 1000));
  app.add_flag("--adapter", adapter_only,
               "write only the low-rank adapters of a fine-tuning run (adapter.rank > 0), as the adapter file --out "
               "(FILE.safetensors, naming the base it was trained on) that dalle-generate --adapter loads; without it "
               "such a run is written merged, its adapters folded into the weights");
  return tools::run_tool(app, argc, argv, [&] {
    if (adapter_only) {
      if (average != 1) throw Error("--adapter writes the latest checkpoint's adapters; leave out --average");
      const auto exported = models::export_adapter(run, out);
      log::info("export: the adapters of ", exported.layers, " layers of ", exported.checkpoint, " (base ",
                exported.base.empty() ? "unnamed" : exported.base, ") -> ", out);
      return;
    }
    const auto exported = models::export_weights(run, out, overrides, average);
    log::info("export: ", exported.tensors, " tensors (", exported.moving_average ? "moving average" : "weights",
              ") of ", exported.checkpoint, exported.averaged.size() > 1 ? " averaged with the " +
              std::to_string(exported.averaged.size() - 1) + " checkpoints before it" : "", " -> ", out,
              exported.merged_adapters > 0 ? " (the adapters of " + std::to_string(exported.merged_adapters) +
                                                 " layers merged)" : "",
              exported.streamed ? " (its shards read and written one resblock at a time)" : "");
  });
}
