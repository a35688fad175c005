// dalle-plan: a capacity plan for training a prior recipe on a cluster (train/capacity_plan.h):
// memory per rank and whether it fits, bytes per update within and across machines, FLOPs
// and a predicted step time, as a table or JSON. Nothing is trained or allocated on a GPU.
#include <iostream>

#include "dalle/train/capacity_plan.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  CLI::App app{"Plans training a prior recipe on a cluster: memory per rank and whether it fits, bytes per update "
               "within and across machines, FLOPs and a predicted step time (docs/distributed.md, \"Capacity "
               "planning\")."};
  app.name("dalle-plan");
  tools::add_common_options(app);
  tools::ConfigOptions config_options;
  config_options.add_to(app, "dalle-train prior recipe (configs/prior/*.yaml; none: DALL-E 12B's defaults)");
  train::ClusterShape cluster;
  int64_t batch = 0;
  bool json = false;
  app.add_option("--nodes", cluster.nodes, "machines")->capture_default_str();
  app.add_option("--gpus-per-node", cluster.gpus_per_node, "GPUs (ranks) per machine")->capture_default_str();
  app.add_option("--gpu-memory", cluster.gpu_memory_gib, "memory of one GPU, GiB")->capture_default_str();
  app.add_option("--peak-tflops", cluster.peak_tflops, "dense 16-bit peak of one GPU, TFLOP/s (H100 bf16: 989)")
      ->capture_default_str();
  app.add_option("--mfu", cluster.mfu, "model FLOPs utilisation assumed for the compute time")->capture_default_str();
  app.add_option("--link-within-gbps", cluster.link_within_gbps,
                 "bandwidth of one GPU to the others of its machine, Gbit/s each way (NVLink 4: 3600)")
      ->capture_default_str();
  app.add_option("--link-across-gbps", cluster.link_across_gbps,
                 "bandwidth of one machine to the others, Gbit/s each way (8 x 400 Gbit/s: 3200)")
      ->capture_default_str();
  app.add_option("--batch", batch, "the global batch (the same as --set data.batch_size=N)");
  app.add_flag("--json", json, "print the plan as JSON instead of a table");
  return tools::run_tool(app, argc, argv, [&] {
    auto source = config_options.source();
    if (batch != 0) source.set("data.batch_size=" + std::to_string(batch));
    if (peek_choice(source, "kind", "prior", {"prior", "bart_prior"}) != "prior") {
      throw tools::UsageError("dalle-plan plans the sparse transformer prior (kind: prior), not bart_prior");
    }
    auto recipe = load_config<train::PriorTrainConfig>(source);
    if (config_options.print_requested(visit_of(recipe))) return;
    try {
      cluster.validate();
    } catch (const Error& error) {
      throw tools::UsageError(error.what());
    }
    const auto plan = train::plan_capacity(recipe, cluster);
    std::cout << (json ? train::capacity_plan_json(plan) : train::capacity_plan_table(plan));
  });
}
