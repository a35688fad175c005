// dalle-export: a trained run's weights for inference only (the EMA, config.yaml, no
// optimizer state), for shipping or for dalle-generate.
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
  app.add_option("run", run, "run directory (its latest checkpoint) or checkpoint directory")->required();
  app.add_option("--out", out, "checkpoint directory to write (replaced only if it is an earlier export)")->required();
  app.add_option("--set", overrides,
                 "key.path=value: rewrite a key of the exported config.yaml, such as a prior's `tokenizer` "
                 "and `image_tokenizer` paths once shipped beside it (repeatable; the key must exist and keep its kind: a number, a flag, a list, text)");
  app.add_option("--average", average,
                 "write the mean of the weights of the run's N newest checkpoints (1: the newest alone); its config is "
                 "the newest's")
      ->check(CLI::Range(1, 1000));
  return tools::run_tool(app, argc, argv, [&] {
    const auto exported = models::export_weights(run, out, overrides, average);
    log::info("export: ", exported.tensors, " tensors (", exported.moving_average ? "moving average" : "weights",
              ") of ", exported.checkpoint, exported.averaged.size() > 1 ? " averaged with the " +
              std::to_string(exported.averaged.size() - 1) + " checkpoints before it" : "", " -> ", out);
  });
}
