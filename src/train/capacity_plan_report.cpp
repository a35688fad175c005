#include "dalle/train/capacity_plan.h"

#include <cstdarg>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "train/capacity_plan_text.h"

namespace dalle::train {
namespace {

using detail::kGiB;
using detail::with_thousands;

constexpr double kMB = 1e6;  // as the metrics' across_machines_mb

std::string printed(const char* format, ...) {
  char text[512];
  va_list arguments;
  va_start(arguments, format);
  std::vsnprintf(text, sizeof text, format, arguments);
  va_end(arguments);
  return text;
}

}  // namespace

// A comma before every third digit from the right: appended, not inserted, since GCC 12 at
// -O3 misreads string::insert here (-Wstringop-overflow) once the function is not inlined.
std::string detail::with_thousands(int64_t value) {
  const auto digits = std::to_string(value);
  std::string grouped;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) grouped += ',';
    grouped += digits[i];
  }
  return grouped;
}

const char* phase_name(MemoryPhase phase) {
  switch (phase) {
    case MemoryPhase::kept: return "kept";
    case MemoryPhase::backward: return "backward";
    case MemoryPhase::backward_head: return "bwd head";
    case MemoryPhase::backward_blocks: return "bwd block";
    case MemoryPhase::backward_embeddings: return "bwd embed";
    case MemoryPhase::reduction: return "reduction";
    case MemoryPhase::host: return "host";
  }
  return "";
}

const char* scope_name(CollectiveScope scope) {
  switch (scope) {
    case CollectiveScope::within: return "within";
    case CollectiveScope::across: return "across";
    case CollectiveScope::spanning: return "spanning";
  }
  return "";
}

std::string capacity_plan_json(const CapacityPlan& plan) {
  const auto& c = plan.cluster;
  nlohmann::json json = {
      {"cluster",
       {{"nodes", c.nodes}, {"gpus_per_node", c.gpus_per_node}, {"ranks", c.ranks()},
        {"gpu_memory_gib", c.gpu_memory_gib}, {"peak_tflops", c.peak_tflops}, {"mfu", c.mfu},
        {"link_within_gbps", c.link_within_gbps}, {"link_across_gbps", c.link_across_gbps}}},
      {"model",
       {{"layers", plan.model.layers}, {"width", plan.model.width}, {"heads", plan.model.heads},
        {"sequence", plan.model.length()}}},
      {"training",
       {{"precision", plan.precision}, {"adam_moments", plan.adam_moments}, {"weights", plan.weights},
        {"sharding", plan.sharding}, {"sharded", plan.sharded}, {"gradient_reduction", plan.gradient_reduction},
        {"checkpointing", plan.checkpointing}, {"global_batch", plan.global_batch},
        {"batch_per_rank", plan.batch_per_rank}, {"tokens_per_rank", plan.tokens_per_rank}}},
      {"parameters",
       {{"total", plan.parameters.total}, {"in_resblocks", plan.parameters.in_resblocks},
        {"outside_resblocks", plan.parameters.outside_resblocks}, {"matrix_weights", plan.parameters.matrix_weights},
        {"per_rank", plan.parameters.per_rank}, {"adapters", plan.parameters.adapters},
        {"trained", plan.parameters.trained}}}};
  auto& memory = json["memory"];
  memory["parts"] = nlohmann::json::array();
  for (const auto& part : plan.memory) {
    memory["parts"].push_back(
        {{"name", part.name}, {"phase", phase_name(part.phase)}, {"bytes", part.bytes}, {"rule", part.rule}});
  }
  memory.update({{"kept_bytes", plan.kept_bytes}, {"backward_bytes", plan.backward_bytes},
                 {"reduction_bytes", plan.reduction_bytes}, {"peak_bytes", plan.peak_bytes},
                 {"capacity_bytes", plan.capacity_bytes}, {"host_bytes", plan.host_bytes}, {"fits", plan.fits},
                 {"too_large", plan.too_large}, {"startup_bytes", plan.startup_bytes},
                 {"fits_at_startup", plan.fits_at_startup}, {"built_sharded", plan.built_sharded}});
  auto& traffic = json["traffic"];
  traffic["parts"] = nlohmann::json::array();
  for (const auto& part : plan.traffic) {
    traffic["parts"].push_back({{"name", part.name}, {"collective", part.collective},
                                {"scope", scope_name(part.scope)}, {"ranks", part.ranks},
                                {"payload_bytes", part.payload_bytes}, {"counted_by", part.counted_by},
                                {"seconds", part.seconds}, {"hidden", part.hidden}});
  }
  traffic.update({{"bytes_within", plan.bytes_within}, {"bytes_across", plan.bytes_across},
                  {"bytes_across_uncompressed", plan.bytes_across_uncompressed}});
  json["compute"] = {{"flops_per_token", plan.flops_per_token}, {"flops_per_update", plan.flops_per_update},
                     {"compute_seconds", plan.compute_seconds},
                     {"exposed_communication_seconds", plan.exposed_communication_seconds},
                     {"step_seconds", plan.step_seconds}, {"tokens_per_second", plan.tokens_per_second}};
  json["notes"] = plan.notes;
  return json.dump(2) + "\n";
}

std::string capacity_plan_table(const CapacityPlan& plan) {
  const auto& c = plan.cluster;
  const auto& p = plan.parameters;
  std::string out;
  out += printed("cluster: %lld machines x %lld GPUs (%lld ranks), %.0f GiB, %.0f TFLOP/s each at %.0f%% MFU; links "
                 "%.0f Gbit/s within a machine (per GPU), %.0f across (per machine)\n",
                 static_cast<long long>(c.nodes), static_cast<long long>(c.gpus_per_node),
                 static_cast<long long>(c.ranks()), c.gpu_memory_gib, c.peak_tflops, 100 * c.mfu, c.link_within_gbps,
                 c.link_across_gbps);
  out += "model: " + with_thousands(p.total) + " parameters (" + with_thousands(p.in_resblocks) + " in " +
         std::to_string(2 * plan.model.layers) + " resblocks, " + with_thousands(p.outside_resblocks) +
         " outside), " + std::to_string(plan.model.layers) + " layers x " + std::to_string(plan.model.width) +
         ", sequence " + std::to_string(plan.model.length()) +
         (p.trained < p.total ? "; " + with_thousands(p.trained) + " train (" + with_thousands(p.adapters) +
                                    " in adapters), the rest frozen"
                              : "") +
         "\n";
  out += "training: batch " + std::to_string(plan.global_batch) + " (" + std::to_string(plan.batch_per_rank) +
         " per rank, " + std::to_string(plan.tokens_per_rank) + " tokens), " + plan.precision + ", moments " +
         plan.adam_moments + (plan.weights != "float32" ? ", weights " + plan.weights : "") + ", sharding " +
         plan.sharding + (plan.sharded ? "" : " (not sharded)") + ", " +
         plan.gradient_reduction + ", checkpointing " + plan.checkpointing + "\n\n";

  out += printed("%-32s %10s  %-9s  %s\n", "memory per rank", "GiB", "when", "counted");
  for (const auto& part : plan.memory) {
    out += printed("  %-30s %10.2f  %-9s  %s\n", part.name.c_str(), part.bytes / kGiB, phase_name(part.phase),
                   part.rule.c_str());
  }
  out += printed("  %-30s %10.2f  = kept %.2f + the larger of backward %.2f and reduction %.2f\n", "peak",
                 plan.peak_bytes / kGiB, plan.kept_bytes / kGiB, plan.backward_bytes / kGiB,
                 plan.reduction_bytes / kGiB);
  std::string verdict = plan.fits ? printed("fits in %.0f GiB", c.gpu_memory_gib)
                                   : printed("does not fit in %.0f GiB (over by %.2f GiB); too large:",
                                             c.gpu_memory_gib, (plan.peak_bytes - plan.capacity_bytes) / kGiB);
  for (size_t i = 0; i < plan.too_large.size(); ++i) verdict += (i ? ", " : " ") + plan.too_large[i];
  out += printed("  %-30s %10.2f  %s\n", "start", plan.startup_bytes / kGiB,
                 plan.built_sharded ? "built one resblock at a time: the weights' shards, the embeddings and head "
                                      "whole until cut, one block whole in fp32 and its flattened copy"
                                    : "the whole model in fp32, built before it is sharded, loaded or copied");
  if (plan.sharded) verdict += plan.fits_at_startup ? "; fits at start" : "; does not fit at start";
  out += "  " + verdict + "\n\n";

  if (!plan.traffic.empty()) {
    out += printed("%-52s %12s  %-14s %-8s %5s %9s  %s\n", "bytes per update per rank", "payload MB", "collective",
                   "group", "ranks", "seconds", "counted by");
    for (const auto& part : plan.traffic) {
      out += printed("  %-50s %12.2f  %-14s %-8s %5lld %9.4f%s  %s\n", part.name.c_str(), part.payload_bytes / kMB,
                     part.collective.c_str(), scope_name(part.scope), static_cast<long long>(part.ranks), part.seconds,
                     part.hidden ? "*" : " ", part.counted_by.empty() ? "(no counter)" : part.counted_by.c_str());
    }
    out += printed("  within machines %.2f MB, across machines %.2f MB", plan.bytes_within / kMB,
                   plan.bytes_across / kMB);
    if (plan.bytes_across_uncompressed > plan.bytes_across * 1.0001) {
      out += printed(" (whole: %.2f MB; %.1f%% fewer)", plan.bytes_across_uncompressed / kMB,
                     100 * (1 - plan.bytes_across / plan.bytes_across_uncompressed));
    }
    out += "\n  * overlaps computation (a block's gather is prefetched one block ahead; with distributed.overlap,\n"
           "    buckets and reduce-scatters start during backward)\n\n";
  }
  out += printed("compute: %.3g FLOP per token, %.3g per update; %.3f s at %.0f%% MFU\n", plan.flops_per_token,
                 plan.flops_per_update, plan.compute_seconds, 100 * c.mfu);
  out += printed("step: %.3f s = compute %.3f s + communication not hidden %.3f s; %.0f tokens/s\n", plan.step_seconds,
                 plan.compute_seconds, plan.exposed_communication_seconds, plan.tokens_per_second);
  for (const auto& note : plan.notes) out += "note: " + note + "\n";
  return out;
}

}  // namespace dalle::train
