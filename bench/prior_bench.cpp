// Benchmarks of the prior, printed as JSON lines (docs/benchmarks.md has the tables):
//   attention: the sparse path against dense masked attention, per mask kind, forward and
//              backward of one attention resblock on a text + 32x32 sequence;
//   generation: image tokens per second with and without the KV cache;
//   generation-xl: image tokens per second and peak memory of KV-cached sampling with
//             ruDALL-E Malevich's layout (1.3B), weights in float32, bfloat16 or float16;
//   generation-mega: the same for DALL-E Mega's (2.6B) or Mini's BART prior, super-conditioned,
//             on the CPU or a GPU, with the decoder's weight-read limit on a GPU;
//   grid-mega: seconds for a whole grid of Mega images, caption to pixels (encoder, 256
//             super-conditioned steps, VQGAN detokenizer), as min-dalle's 3x3 grid is timed;
//             the three generation benchmarks take --cuda-graphs=off to launch each step's
//             kernels one by one instead of replaying CUDA graphs (on a GPU; on by default);
//   training: tokens per second and peak resident memory of full training steps, in a
//             chosen precision (fp32, bf16, fp16 with per-resblock gradient scales), with
//             or without activation checkpointing; on a GPU also peak CUDA memory and model
//             FLOPs utilisation (training-xl-slice --layers=24 is the whole 1.3B layout);
//             --finetune=emojich freezes the attention and MLP matrices (ruDALL-E Emojich's
//             recipe), --finetune=adapters --adapter-rank=R trains rank-R adapters on them alone;
//             --frozen-weights=bfloat16|float16 keeps the frozen resblock matrices in 16 bits;
//             adamw_s times the optimizer's step alone: LibTorch's fused kernel on the CPU, on
//             CUDA with --fused-adamw=on (torch's tensor-by-tensor loop there otherwise);
//   data-parallel: the same steps on N processes of this machine, with the bytes each rank
//             hands to all-reduce;
//   trainer:  dalle-train's own PriorTrainer on random tokens of a recipe's layout
//             (--config=configs/prior/rudalle-xl.yaml, --set=key=value repeated): the mean
//             update time from its metrics, peak memory (CUDA on a GPU) beside dalle-plan's peak
//             for the same recipe on one GPU of --gpu-memory GiB, and model FLOPs utilisation:
//             what a run gets with its recipe's state (sharding on one GPU, 16-bit weights).
// Ratios are taken within one run, on one machine.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <sys/resource.h>
#include <unistd.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_set>

#include "dalle/distributed/data_parallel.h"
#include "dalle/distributed/job.h"
#include "dalle/distributed/local_ranks.h"
#include "dalle/distributed/powersgd.h"
#include "dalle/distributed/sharded_parameters.h"
#include "dalle/distributed/sharded_reducer.h"
#include "dalle/device.h"
#include "dalle/models/bart_sampling.h"
#include "dalle/models/linear.h"
#include "dalle/models/vqgan_detokenizer.h"
#include "dalle/error.h"
#include "dalle/log.h"
#include "dalle/config.h"
#include "dalle/data/token_dataset.h"
#include "dalle/models/adapter.h"
#include "dalle/models/prior.h"
#include "dalle/models/prior_flops.h"
#include "dalle/models/prior_sampling.h"
#include "dalle/runtime.h"
#include "dalle/train/adamw.h"
#include "dalle/train/capacity_plan.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/resblock_runner.h"
#include "dalle/train/sharded_prior.h"
#include "dalle/train/trainable.h"
#include "dalle/train/trainers/prior_trainer.h"
#include "dalle/train/update_step.h"

using namespace dalle;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Median-free but warm: one untimed call, then the mean of `repeats`.
template <class Body>
double time_per_call(int repeats, Body body) {
  body();
  const auto start = Clock::now();
  for (int i = 0; i < repeats; ++i) body();
  return seconds_since(start) / repeats;
}

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

torch::Tensor random_tokens(const models::PriorConfig& config, int64_t batch) {
  return torch::cat({torch::randint(4, config.text_vocab_size, {batch, config.text_length}),
                     torch::randint(0, config.image_vocab_size, {batch, config.image_length()})},
                    1);
}

void attention(int64_t text_length, int64_t width, int64_t heads, int repeats) {
  const models::SequenceLayout layout{.text_length = text_length, .grid_size = 32};
  const int64_t length = layout.length(), head_width = width / heads;
  for (const char* kind : {"row", "column", "conv"}) {
    const models::LayerMask mask({.kind = models::parse_attention_kind(kind), .conv_kernel = 11}, layout);
    auto q = torch::randn({1, heads, length, head_width}, torch::requires_grad());
    auto k = torch::randn({1, heads, length, head_width}, torch::requires_grad());
    auto v = torch::randn({1, heads, length, head_width}, torch::requires_grad());
    nlohmann::json line = {{"benchmark", "attention"}, {"mask", kind}, {"text", text_length}, {"grid", 32},
                           {"heads", heads}, {"head_width", head_width}};
    for (auto path : {models::AttentionPath::dense, models::AttentionPath::sparse}) {
      const std::string name = path == models::AttentionPath::dense ? "dense" : "sparse";
      line[name + "_forward_ms"] = 1e3 * time_per_call(repeats, [&] {
        torch::NoGradGuard no_grad;
        models::masked_attention(q, k, v, mask, 0, path);
      });
      line[name + "_forward_backward_ms"] = 1e3 * time_per_call(repeats, [&] {
        models::masked_attention(q, k, v, mask, 0, path).sum().backward();
      });
    }
    line["forward_speedup"] = line["dense_forward_ms"].get<double>() / line["sparse_forward_ms"].get<double>();
    line["forward_backward_speedup"] =
        line["dense_forward_backward_ms"].get<double>() / line["sparse_forward_backward_ms"].get<double>();
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
  }
}

void generation(const models::PriorConfig& config, int64_t batch, const std::string& name) {
  torch::manual_seed(0);
  models::Prior prior(config);
  prior->eval();
  const auto captions = random_tokens(config, batch).index({torch::indexing::Slice(), torch::indexing::Slice(0, config.text_length)});
  nlohmann::json line = {{"benchmark", "generation"}, {"model", name}, {"batch", batch},
                         {"image_tokens", config.image_length()}, {"layers", config.layers}, {"width", config.width}};
  for (bool cached : {true, false}) {
    const auto start = Clock::now();
    models::sample_image_tokens(prior, captions, {.use_cache = cached, .seed = 1});
    const double elapsed = seconds_since(start);
    line[cached ? "cached_tokens_per_s" : "uncached_tokens_per_s"] =
        static_cast<double>(batch * config.image_length()) / elapsed;
  }
  line["cache_speedup"] = line["cached_tokens_per_s"].get<double>() / line["uncached_tokens_per_s"].get<double>();
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

// Thrown from the sampler's progress callback once the tokens to time are drawn.
struct EnoughTokens {};

// A token sampler given the samplers' callback after each image position.
using TokenSampler = std::function<void(const models::TokenCallback&)>;

// Seconds between the 4th and the (4 + timed)-th image token `sample` draws, so that the
// caption's prefill does not count; the sampling stops there.
// On a GPU each timed token is waited for, since the host may run ahead of the kernels.
double seconds_for_tokens(int64_t timed, const TokenSampler& sample, bool on_gpu = false) {
  constexpr int64_t kUntimed = 4;
  Clock::time_point first;
  double seconds = 0;
  try {
    sample([&](int64_t done, int64_t, const torch::Tensor&) {
      if (on_gpu) torch::cuda::synchronize();
      if (done == kUntimed) first = Clock::now();
      if (done < kUntimed + timed) return;
      seconds = seconds_since(first);
      throw EnoughTokens{};
    });
  } catch (const EnoughTokens&) {
  }
  return seconds;
}

// `line` with the rate of `images` images over `timed` tokens and the memory, printed.
void print_generation(nlohmann::json line, int64_t images, int64_t timed, double seconds, double rss_built) {
  line["timed_tokens"] = timed;
  line["image_tokens_per_s"] = static_cast<double>(images * timed) / seconds;
  line["seconds_per_step"] = seconds / static_cast<double>(timed);
  line["threads"] = torch::get_num_threads();
  line["peak_rss_mib_after_build"] = rss_built;
  line["peak_rss_mib"] = peak_rss_mib();
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

int64_t parameter_count(std::initializer_list<const torch::nn::Module*> modules) {
  int64_t count = 0;
  for (const auto* module : modules) {
    for (const auto& p : module->parameters()) count += p.numel();
  }
  return count;
}

void add_weight_read_limit(nlohmann::json& line, const torch::nn::Module& decoder, const torch::Device& device);

// Whether the steps were replayed as CUDA graphs, and how many graphs and replays there were.
void add_graph_counts(nlohmann::json& line, const models::DecodeGraphs& graphs, const torch::Device& device) {
  line["cuda_graphs"] = graphs.captures_on(device);
  line["graphs_captured"] = graphs.graphs();
  line["graph_replays"] = graphs.replays();
}

// The type the weights of a `dtype` model are built in: int8 quantizes float32 ones after.
torch::ScalarType built_type(const std::string& dtype) {
  return dtype == "int8" ? torch::kFloat32 : float_type_named(dtype);
}

// With dtype int8, quantizes the model's linear layers (as the pipeline does on load).
void quantize_if_int8(torch::nn::Module& model, const std::string& dtype) {
  if (dtype == "int8") models::quantize_linears_int8(model);
}

// The first `timed + 4` image tokens of `batch` images, KV-cached, the weights built directly in
// `dtype` (as load_trained_prior builds them).
void generation_at_layout(const models::PriorConfig& config, int64_t batch, int64_t timed, const std::string& dtype,
                          const torch::Device& device, const std::string& name, bool cuda_graphs) {
  const auto default_dtype = torch::get_default_dtype();
  torch::set_default_dtype(c10::scalarTypeToTypeMeta(built_type(dtype)));
  torch::manual_seed(0);
  models::Prior prior(config);
  torch::set_default_dtype(default_dtype);
  prior->eval();
  prior->to(device);
  const auto parameters = parameter_count({prior.get()});
  quantize_if_int8(*prior, dtype);
  // What the model holds once built, after any float weights an int8 model was made from are freed.
  const double rss_ready = process_memory_mib("VmRSS");
  const double rss_built = peak_rss_mib();
  const auto captions = random_tokens(config, batch).slice(1, 0, config.text_length).to(device);
  models::DecodeGraphs graphs(cuda_graphs);
  const auto sample = [&](const auto& on_token) {
    models::sample_image_tokens(prior, captions, {.seed = 1}, nullptr, on_token, {}, nullptr, {}, &graphs);
  };
  // A GPU's first pass picks kernels for every length of the growing cache and captures the
  // steps' graphs: not the step's cost.
  if (device.is_cuda()) seconds_for_tokens(timed, sample, true);
  const double seconds = seconds_for_tokens(timed, sample, device.is_cuda());
  nlohmann::json line = {
      {"benchmark", "generation-xl"}, {"model", name},  {"dtype", dtype},
      {"device", device.str()},       {"batch", batch}, {"parameters", parameters}, {"rss_mib_ready", rss_ready}};
  add_graph_counts(line, graphs, device);
  if (device.is_cuda()) add_weight_read_limit(line, *prior, device);
  print_generation(line, batch, timed, seconds, rss_built);
}

// The most bytes torch's CUDA allocator has held for tensors on `device` since the last reset.
double peak_cuda_mib(const torch::Device& device) {
  const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  return static_cast<double>(
             stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak) /
         1048576.0;
}

// The bytes of a module's parameters: what one decoding step reads at batch 1.
int64_t parameter_bytes(const torch::nn::Module& module) {
  int64_t bytes = 0;
  for (const auto& p : module.parameters()) bytes += p.numel() * static_cast<int64_t>(p.element_size());
  return bytes;
}

// The GPU's memory bandwidth as a large device-to-device copy reaches it (bytes read plus
// written per second): the measured ceiling a weight-bound step is compared against.
double copy_bandwidth_gb_per_s(const torch::Device& device) {
  const auto source = torch::empty({int64_t{1} << 30}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
  auto target = torch::empty_like(source);
  const double seconds = time_per_call(10, [&] {
    target.copy_(source);
    torch::cuda::synchronize();
  });
  return 2.0 * static_cast<double>(source.numel()) / seconds / 1e9;
}

// `line` with the weight-read limit of one decoding step of `decoder` at one image: its bytes
// over the copy bandwidth measured on `device`.
void add_weight_read_limit(nlohmann::json& line, const torch::nn::Module& decoder, const torch::Device& device) {
  const double bandwidth = copy_bandwidth_gb_per_s(device);
  const auto bytes = parameter_bytes(decoder);
  line["decoder_weight_bytes"] = bytes;
  line["copy_bandwidth_gb_per_s"] = bandwidth;
  line["weight_read_limit_s_per_step"] = static_cast<double>(bytes) / (bandwidth * 1e9);
}

// DALL-E Mega's (or Mini's) BART prior with random weights built in the type `dtype` names,
// on `device`.
models::BartPrior random_mega(const models::BartPriorConfig& config, torch::ScalarType dtype,
                              const torch::Device& device) {
  const auto default_dtype = torch::get_default_dtype();
  torch::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
  torch::manual_seed(0);
  models::BartPrior prior(config);
  torch::set_default_dtype(default_dtype);
  prior->eval();
  prior->to(device);
  return prior;
}

// `images` copies of one 22-token caption, as scripts/bench-mindalle-generation.py gives min-dalle.
torch::Tensor mega_captions(const models::BartPriorConfig& config, int64_t images) {
  auto caption = torch::full({config.text_length}, models::kBartPadId, torch::kInt64);
  caption.slice(0, 0, 22) = torch::cat({torch::tensor({0}), torch::arange(100, 120), torch::tensor({2})});
  return caption.expand({images, -1}).contiguous();
}

// The first `timed + 4` image tokens of `images` images of one caption, super-conditioned,
// as scripts/bench-mindalle-generation.py times min-dalle's loop. On a GPU the line adds the
// decoder's weight-read limit: its bytes over the measured copy bandwidth.
void generation_mega(const models::BartPriorConfig& config, int64_t images, int64_t timed, const std::string& dtype,
                     const torch::Device& device, const std::string& name, bool cuda_graphs) {
  auto mega = random_mega(config, built_type(dtype), device);
  const auto parameters = parameter_count({mega.get()});
  quantize_if_int8(*mega, dtype);
  const double rss_ready = process_memory_mib("VmRSS");
  const double rss_built = peak_rss_mib();
  const auto captions = mega_captions(config, images);
  models::DecodeGraphs graphs(cuda_graphs);
  const auto sample = [&](const auto& on_token) {
    models::sample_bart_image_tokens(mega->encoder, mega->decoder, captions, {.seed = 1}, {}, on_token, {}, &graphs);
  };
  // A GPU's first pass picks kernels for every length of the growing cache: not the step's cost.
  if (device.is_cuda()) seconds_for_tokens(timed, sample, true);
  const double seconds = seconds_for_tokens(timed, sample, device.is_cuda());
  nlohmann::json line = {{"benchmark", "generation-mega"}, {"model", name}, {"dtype", dtype},
                         {"device", device.str()}, {"images", images}, {"parameters", parameters},
                         {"rss_mib_ready", rss_ready}};
  add_graph_counts(line, graphs, device);
  if (device.is_cuda()) add_weight_read_limit(line, *mega->decoder, device);
  print_generation(line, images, timed, seconds, rss_built);
}

// Seconds from caption to a grid of `images` Mega images on `device`: the encoder, all 256
// super-conditioned steps, min-dalle's VQGAN detokenizer (float32, as min-dalle runs it) and
// the grid on the host. The first grid warms the kernels up; the second is timed.
void grid_mega(int64_t images, const std::string& dtype, const torch::Device& device, bool cuda_graphs) {
  const auto config = models::dalle_mega_config();
  auto mega = random_mega(config, built_type(dtype), device);
  quantize_if_int8(*mega, dtype);
  models::VqganDetokenizer detokenizer(models::dalle_mega_detokenizer_config());
  detokenizer->eval();
  detokenizer->to(device);
  const auto captions = mega_captions(config, images);
  models::DecodeGraphs graphs(cuda_graphs);
  const auto grid = [&] {
    torch::NoGradGuard no_grad;
    const auto tokens =
        models::sample_bart_image_tokens(mega->encoder, mega->decoder, captions, {.seed = 1}, {}, {}, {}, &graphs);
    return models::min_dalle_grid(detokenizer->forward(tokens)).to(torch::kCPU);
  };
  auto start = Clock::now();
  grid();
  const double first = seconds_since(start);
  start = Clock::now();
  grid();
  const double seconds = seconds_since(start);
  nlohmann::json line = {{"benchmark", "grid-mega"}, {"model", "DALL-E Mega layout"}, {"dtype", dtype},
                         {"device", device.str()}, {"images", images}, {"image_tokens", config.image_length},
                         {"seconds_first_grid", first}, {"seconds_per_grid", seconds},
                         {"image_tokens_per_s", static_cast<double>(images * 256) / seconds},
                         {"peak_rss_mib", peak_rss_mib()}};
  add_graph_counts(line, graphs, device);
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

struct TrainingOptions {
  std::string precision = "float32";  // precision.mode, as a recipe spells it
  int64_t checkpoint_every = 0;
  std::string finetune = "full";  // full, emojich (matrices frozen) or adapters (on the matrices, the rest frozen)
  int64_t adapter_rank = 8;
  std::string frozen_weights = "float32";  // storage of the frozen resblock matrices: float32, bfloat16 or float16
  bool fused_adamw_on_cuda = false;
  torch::Device device = torch::kCPU;
  double peak_tflops = 989;  // the GPU's dense 16-bit peak (H100 and H200 SXM): the MFU's denominator
};

void training(const models::PriorConfig& config, int64_t batch, int steps, const std::string& name,
              const TrainingOptions& options) {
  torch::manual_seed(0);
  const double rss_before = peak_rss_mib();
  models::Prior prior(config);
  const std::vector<std::string> matrices{"resblocks.*.qkv", "resblocks.*.out", "resblocks.*.fc_in",
                                          "resblocks.*.fc_out"};
  if (options.finetune == "adapters") {
    const models::AdapterConfig adapter{.rank = options.adapter_rank, .alpha = 16, .targets = matrices};
    models::add_adapters(*prior, adapter);
    train::freeze_all_but(*prior, train::trainable_patterns({}, adapter), "bench");
  } else if (options.finetune == "emojich") {
    train::freeze_all_but(*prior, {"*embedding*", "resblocks.*norm.*", "final_norm.*", "to_logits.*"}, "bench");
  } else if (options.finetune != "full") {
    throw Error("--finetune: full, emojich or adapters");
  }
  if (options.frozen_weights != "float32") {
    if (options.precision == "float32") {
      throw Error("--frozen-weights " + options.frozen_weights + " needs --precision bfloat16 or float16");
    }
    train::store_frozen_matrices(*prior, "resblocks.", float_type_named(options.frozen_weights));
  }
  prior->to(options.device);
  const bool on_gpu = options.device.is_cuda();
  train::PrecisionConfig precision_config;
  precision_config.mode = options.precision;
  train::ModelPrecision precision(precision_config, prior->parameters(),
                                  train::resblock_parameter_groups(prior->resblocks()));
  prior->set_resblock_runner(train::make_training_runner(prior->resblocks(),
                                                         {.precision = precision_config.precision(),
                                                          .scaler = precision.scaler(),
                                                          .checkpoint_every = options.checkpoint_every}));
  train::AdamW optimizer({torch::optim::OptimizerParamGroup(train::trained_only(prior->parameters()))},
                         torch::optim::AdamWOptions(1e-4));
  optimizer.fuse_on_cuda(options.fused_adamw_on_cuda);
  train::UpdateStep update(optimizer, precision, {.what = "bench"});
  const auto tokens = random_tokens(config, batch).to(options.device);
  int64_t skipped = 0;
  auto step = [&] {
    const auto loss = models::prior_loss(prior->forward(tokens), tokens, config).total;
    skipped += update.apply(loss, 1).skipped;
    if (on_gpu) torch::cuda::synchronize();
  };
  const double seconds = time_per_call(steps, step);
  // The last update's gradients stay: AdamW's step alone, as each update takes it.
  const double adamw_seconds = time_per_call(steps, [&] {
    optimizer.step();
    if (on_gpu) torch::cuda::synchronize();
  });
  int64_t parameters = 0, trained = 0;
  for (const auto& p : prior->parameters()) {
    parameters += p.numel();
    trained += p.requires_grad() ? p.numel() : 0;
  }
  const double tokens_per_s = static_cast<double>(batch * config.length()) / seconds;
  nlohmann::json line = {{"benchmark", "training"},
                         {"model", name},
                         {"device", options.device.str()},
                         {"layers", config.layers},
                         {"width", config.width},
                         {"parameters", parameters},
                         {"batch", batch},
                         {"sequence", config.length()},
                         {"attention_path", config.attention_path},
                         {"precision", options.precision},
                         {"checkpoint_every", options.checkpoint_every},
                         {"finetune", options.finetune == "adapters" ? "adapters rank " + std::to_string(options.adapter_rank)
                                                                      : options.finetune},
                         {"frozen_weights", options.frozen_weights},
                         {"trained_parameters", trained},
                         {"skipped_updates", skipped},
                         {"step_s", seconds},
                         {"adamw_s", adamw_seconds},
                         {"fused_adamw", !on_gpu || options.fused_adamw_on_cuda},
                         {"tokens_per_s", tokens_per_s},
                         {"peak_rss_mib", peak_rss_mib()},
                         {"rss_before_mib", rss_before}};
  if (on_gpu) {
    const double flops_per_token = models::prior_flops_per_token(models::matrix_weights(*prior), config);
    line["model_flops_per_token"] = flops_per_token;
    line["model_tflops_per_s"] = flops_per_token * tokens_per_s / 1e12;
    line["peak_tflops"] = options.peak_tflops;
    line["mfu"] = flops_per_token * tokens_per_s / (options.peak_tflops * 1e12);
    line["peak_cuda_mib"] = peak_cuda_mib(options.device);
  }
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

// `steps` timed updates (after a warm one) of dalle-train's PriorTrainer with `recipe`, on
// random tokens of its layout written to a scratch folder (removed after).
void trainer_steps(train::PriorTrainConfig recipe, const std::string& name, int64_t steps, double gpu_memory_gib,
                   const TrainingOptions& options) {
  const auto scratch = std::filesystem::temp_directory_path() / ("dalle-bench-trainer-" + std::to_string(getpid()));
  std::filesystem::remove_all(scratch);
  const auto& model = recipe.model;
  data::TokenDatasetWriter writer((scratch / "tokens").string(),
                                  {.image_vocab_size = model.image_vocab_size, .text_vocab_size = model.text_vocab_size,
                                   .grid_height = model.grid_size, .grid_width = model.grid_size,
                                   .text_length = model.text_length, .source = "random"});
  for (int64_t i = 0; i < recipe.data.batch_size * (steps + 1); ++i) {
    writer.add(torch::randint(model.image_vocab_size, {model.grid_size, model.grid_size}),
               torch::randint(1, model.text_vocab_size, {1, model.text_length}), {"random"});
  }
  writer.finish();
  recipe.data.train = (scratch / "tokens").string();
  recipe.data.validation.clear();
  recipe.tokenizer.clear();  // no sample grids
  recipe.image_tokenizer.clear();
  recipe.run = {.steps = steps + 1, .log_every = 1, .validate_every = 1 << 30, .checkpoint_every = 1 << 30};
  recipe.run.device = options.device.str();
  const auto plan = train::plan_capacity(recipe, {.nodes = 1, .gpus_per_node = 1, .gpu_memory_gib = gpu_memory_gib});
  const double rss_before = peak_rss_mib();
  train::PriorTrainer(recipe, (scratch / "run").string()).run();
  double seconds = 0;
  std::ifstream metrics(scratch / "run" / "metrics.jsonl");
  for (std::string text; std::getline(metrics, text);) {
    const auto line = nlohmann::json::parse(text);
    if (line.value("step", 0) > 1 && line.contains("update_seconds")) seconds += line["update_seconds"].get<double>();
  }
  seconds /= static_cast<double>(steps);
  std::filesystem::remove_all(scratch);
  const double tokens_per_s = static_cast<double>(recipe.data.batch_size * model.length()) / seconds;
  nlohmann::json line = {{"benchmark", "trainer"}, {"model", name}, {"device", options.device.str()},
                         {"batch", recipe.data.batch_size}, {"precision", recipe.precision.mode},
                         {"weights", recipe.precision.weights}, {"sharding", recipe.distributed.sharding},
                         {"step_s", seconds}, {"tokens_per_s", tokens_per_s},
                         {"planned_peak_gib", plan.peak_bytes / 1073741824.0},
                         {"planned_host_gib", plan.host_bytes / 1073741824.0},
                         {"planned_fits", plan.fits}, {"peak_rss_mib", peak_rss_mib()}, {"rss_before_mib", rss_before}};
  if (options.device.is_cuda()) {
    const double flops_per_token =
        models::prior_flops_per_token(static_cast<double>(plan.parameters.matrix_weights), model);
    const double peak_cuda = peak_cuda_mib(options.device);
    line["peak_cuda_mib"] = peak_cuda;
    line["peak_cuda_over_plan"] = peak_cuda / (plan.peak_bytes / 1048576.0);
    line["mfu"] = flops_per_token * tokens_per_s / (options.peak_tflops * 1e12);
  }
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

// How the ranks of data_parallel talk: overlapped or not, in buckets of how many bytes, each
// sharded block's backward prefetching before its gradients or after (distributed.
// backward_prefetch), and over which simulated link: a fixed one, or one whose communication
// alone takes `comm_ratio` times the step measured without it.
struct LinkOptions {
  bool overlap = true;
  bool prefetch_before_gradients = true;
  int64_t bucket_bytes = 25 << 20;
  distributed::SimulatedLink link = {};
  double comm_ratio = 0;
};

// Data-parallel training steps of `config` on `ranks` processes of this machine (this
// program again, through dalle's --nproc-per-node launcher), with a global batch of
// `batch`: step time, and what each rank hands to all-reduce against what a ring
// all-reduce of the parameters must send. Under a simulated link, the step without it
// ("compute") is measured first, then the step over the link, whose busy time per step
// ("communication") is bytes sent over bandwidth: the share of it hidden under compute is
// (compute + communication - step) / communication.
void data_parallel(const models::PriorConfig& config, int64_t batch, int steps, const std::string& name,
                   const std::vector<std::string>& arguments, int64_t ranks, bool sharded, LinkOptions link) {
  const auto place = distributed::read_launch_environment();
  if (place.launcher == "none" && ranks > 1) {
    const auto outcome = distributed::run_local_ranks({.ranks = ranks, .arguments = arguments, .threads_per_rank = 1});
    if (outcome.failed_rank >= 0) throw Error("rank " + std::to_string(outcome.failed_rank) + " " + outcome.failure);
    return;
  }
  if (place.rank > 0) log::set_console_level(log::Level::warn);
  distributed::Job job(
      place, {.timeout = std::chrono::minutes(10), .bucket_bytes = link.bucket_bytes, .overlap = link.overlap}, {});
  torch::manual_seed(0);
  models::Prior prior(config);
  int64_t parameters = 0;
  for (const auto& p : prior->parameters()) parameters += p.numel();
  // Sharded: the shards are what AdamW steps.
  std::unique_ptr<train::ShardedPrior> shards;
  std::vector<torch::Tensor> learned;
  if (sharded && job.size() > 1) {
    shards = std::make_unique<train::ShardedPrior>(
        *prior, [](const std::string&, const torch::Tensor& p) { return p.dim() == 2; }, job.within_node(),
        train::ShardedCollectives{.overlap = link.overlap,
                                  .prefetch_before_gradients = link.prefetch_before_gradients});
    for (const auto& shard : shards->parameters()->shards()) learned.push_back(shard);
    prior->set_resblock_runner(shards->runner(
        [](models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
          return x + block.branch(x, context);
        }));
  } else {
    learned = prior->parameters();
  }
  train::ModelPrecision precision(train::PrecisionConfig{}, learned, job.size());
  train::AdamW optimizer({torch::optim::OptimizerParamGroup(learned)}, torch::optim::AdamWOptions(1e-4));
  train::UpdateStep update(optimizer, precision, {.what = "bench"});
  std::shared_ptr<distributed::ShardedReducer> sharded_reducer;
  if (shards) {
    sharded_reducer = std::make_shared<distributed::ShardedReducer>(
        shards->parameters(), job.group(), job.within_node(), job.across_nodes(), link.bucket_bytes, std::nullopt,
        link.overlap);
    update.set_reducer(sharded_reducer);
  } else {
    update.set_reducer(job.reducer());
  }
  if (batch % job.size() != 0) {
    throw Error("a global batch of " + std::to_string(batch) + " does not split between " +
                std::to_string(job.size()) + " ranks");
  }
  const auto tokens = random_tokens(config, batch / job.size());
  int64_t calls = 0;
  auto step = [&] {
    update.apply(models::prior_loss(prior->forward(tokens), tokens, config).total, 1);
    ++calls;
  };
  double seconds = time_per_call(steps, step);
  nlohmann::json over_link;
  if (job.group() && (link.link.enabled() || link.comm_ratio > 0)) {
    // Every rank takes the same link: from the ranks' mean compute and bytes. Sharded, the
    // blocks' collectives go on the machine's group of their own: it takes the link too (each
    // group its own, a simulation that lets the two overlap on one wire).
    std::vector<std::shared_ptr<distributed::ProcessGroup>> groups{job.group()};
    if (shards) groups.push_back(job.within_node());
    const auto bytes_sent = [&] {
      double bytes = 0;
      for (const auto& group : groups) bytes += group->bytes_sent();
      return bytes;
    };
    const double sent_before = bytes_sent();
    step();
    std::vector<double> measured{seconds, bytes_sent() - sent_before};
    job.average(measured);
    auto simulated = link.link;
    if (link.comm_ratio > 0) simulated.gigabits_per_second = measured[1] * 8 / (link.comm_ratio * measured[0]) / 1e9;
    for (const auto& group : groups) group->set_simulated_link(simulated);
    const double over = time_per_call(steps, step);
    const double communication = measured[1] * 8 / (simulated.gigabits_per_second * 1e9);
    over_link = {{"link_gbps", simulated.gigabits_per_second},
                 {"link_latency_ms", simulated.latency_ms},
                 {"bytes_sent_per_step", measured[1]},
                 {"compute_s", measured[0]},
                 {"communication_s", communication},
                 {"communication_over_compute", communication / measured[0]},
                 {"step_over_compute", over / measured[0]},
                 {"hidden_share", std::clamp((measured[0] + communication - over) / communication, 0.0, 1.0)}};
    seconds = over;
  }
  const auto* reducer = dynamic_cast<const distributed::DataParallelReducer*>(job.reducer().get());
  // Weights, gradients and the two fp32 moments this rank keeps between steps.
  int64_t state_bytes = 0;
  for (const auto& p : learned) state_bytes += p.numel() * 16;
  std::vector<double> rss{peak_rss_mib()};
  job.average(rss);
  if (!job.is_main()) return;
  nlohmann::json line = {
      {"benchmark", "data_parallel"}, {"model", name}, {"ranks", job.size()}, {"parameters", parameters},
      {"overlap", link.overlap}, {"bucket_bytes", link.bucket_bytes},
      {"backward_prefetch", link.prefetch_before_gradients ? "before_gradients" : "after_gradients"},
      {"sharding", shards ? "within_node" : "none"}, {"state_mib_per_rank", state_bytes / 1048576.0},
      {"global_batch", batch}, {"step_s", seconds}, {"tokens_per_s", batch * config.length() / seconds},
      // What this rank handed to collectives: the data-parallel all-reduce of the gradients,
      // or, sharded, the blocks gathered twice and reduce-scattered once plus the
      // all-reduce of the replicated rest.
      {"collective_payload_bytes_per_step",
       shards ? (shards->parameters()->bytes_moved() + sharded_reducer->bytes_reduced()) / calls
              : (reducer ? reducer->bytes_reduced() / calls : 0)},
      {"parameter_bytes", parameters * 4},
      {"mean_peak_rss_mib_per_rank", rss[0]}};
  if (!over_link.empty()) line["simulated_link"] = over_link;
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

// The share of gradient values PowerSGD at `rank` saves a replica of the prior `config`,
// computed by the reducers' rules on the real parameter shapes (one layer built, its blocks
// counted `config.layers` times; the embeddings and output layer once, whole): flat, as data
// parallelism runs it, and hierarchical, as DALL-E did, each resblock sharded between the
// `per_machine` ranks of a machine as dalle-train shards it (its matrices, then the rest) and
// each shard's blocks of rows compressed at rank / `per_machine` across the machines; beside
// them the paper's 1 - 5r/(8 d_model).
void powersgd_compression(models::PriorConfig config, int64_t rank, int64_t per_machine, const std::string& name) {
  const int64_t layers = config.layers;
  config.layers = 1;
  models::Prior prior(config);
  const distributed::PowerSgdOptions flat{.rank = rank}, per_shard{.rank = rank / per_machine};
  std::unordered_set<const torch::TensorImpl*> in_blocks;
  std::vector<std::vector<std::vector<int64_t>>> groups;  // each resblock's matrices, then its rest
  for (const auto& block : prior->resblocks()) {
    std::vector<std::vector<int64_t>> matrices, rest;
    for (const auto& item : block->named_parameters()) {
      in_blocks.insert(item.value().unsafeGetTensorImpl());
      (item.value().dim() == 2 ? matrices : rest).push_back(item.value().sizes().vec());
    }
    groups.push_back(std::move(matrices));
    groups.push_back(std::move(rest));
  }
  double whole = 0, sent = 0, block_whole = 0, block_sent = 0, outside = 0;
  for (const auto& p : prior->parameters()) {
    const bool in_block = in_blocks.count(p.unsafeGetTensorImpl()) > 0;
    const double times = in_block ? static_cast<double>(layers) : 1.0;
    whole += static_cast<double>(p.numel()) * times;
    sent += static_cast<double>(distributed::values_sent(p.sizes().vec(), flat)) * times;
    if (in_block) {
      block_whole += static_cast<double>(p.numel()) * times;
      block_sent += static_cast<double>(distributed::values_sent(p.sizes().vec(), flat)) * times;
    } else {
      outside += static_cast<double>(p.numel());
    }
  }
  double hierarchical = 0;  // values a machine's ranks send across machines per layer
  for (const auto& group : groups) {
    int64_t values = 0;
    for (const auto& shape : group) values += std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    const int64_t shard = (values + per_machine - 1) / per_machine;
    for (int64_t r = 0; r < per_machine; ++r) {
      int64_t left = shard;
      for (const auto& rows : distributed::rows_in_shard(group, r, per_machine)) {
        if (!distributed::compresses(rows.rows, rows.columns, per_shard)) continue;
        left -= rows.rows * rows.columns;
        hierarchical += static_cast<double>((rows.rows + rows.columns) *
                                            distributed::effective_rank(rows.rows, rows.columns, per_shard));
      }
      hierarchical += static_cast<double>(left);
    }
  }
  hierarchical *= static_cast<double>(layers);
  const double paper = 5.0 * static_cast<double>(rank) / (8.0 * static_cast<double>(config.width));
  const nlohmann::json line = {{"benchmark", "powersgd_compression"},
                               {"model", name},
                               {"width", config.width},
                               {"layers", layers},
                               {"rank", rank},
                               {"ranks_per_machine", per_machine},
                               {"parameters", whole},
                               {"saved_flat", 1.0 - sent / whole},
                               {"saved_flat_in_resblocks", 1.0 - block_sent / block_whole},
                               {"saved_hierarchical", 1.0 - (hierarchical + outside) / whole},
                               {"saved_hierarchical_in_resblocks", 1.0 - hierarchical / block_whole},
                               {"paper_formula", 1.0 - paper}};
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

// The cost of PowerSGD's orthogonalization (Householder QR of P + 1e-6 I) at DALL-E 12B's
// rank 896 for P of the 12B's matrix heights (d_model 3968, and 4 d_model for the MLP), as
// flat PowerSGD would make it, and at its 112 per shard of 8 for the tallest blocks of rows
// a shard holds (d/2 rows of the attention's matrices, d rows of the MLP's first).
void powersgd_qr(int repeats) {
  for (const auto& [rows, rank] : std::vector<std::pair<int64_t, int64_t>>{{3968, 896}, {4 * 3968, 896},
                                                                          {3968 / 2, 112}, {3968, 112}}) {
    const auto p = torch::randn({rows, rank});
    const double seconds = time_per_call(repeats, [&] {
      const auto regularized = p + 1e-6 * torch::eye(rows, rank);
      std::get<0>(torch::linalg_qr(regularized, "reduced"));
    });
    const nlohmann::json line = {{"benchmark", "powersgd_qr"}, {"rows", rows}, {"rank", rank},
                                 {"threads", at::get_num_threads()}, {"seconds", seconds}};
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
  }
}

models::PriorConfig tiny() {
  models::PriorConfig config;
  config.text_length = 24;
  config.text_vocab_size = 128;
  config.grid_size = 8;
  config.image_vocab_size = 512;
  config.layers = 4;
  config.width = 128;
  config.heads = 4;
  config.conv_kernel = 5;
  return config;
}

// A few layers of ruDALL-E XL's 1.3B layout (width 2048, 16 heads, 128 + 32x32 tokens).
models::PriorConfig rudalle_xl_slice(int64_t layers) {
  models::PriorConfig config;
  config.text_length = 128;
  config.grid_size = 32;
  config.layers = layers;
  config.width = 2048;
  config.heads = 16;
  config.sandwich_norm = true;
  config.head_norm = true;
  config.gelu = "tanh";
  return config;
}

// "--name=value" among the arguments, or `fallback`.
std::string option(int argc, char** argv, const std::string& name, const std::string& fallback) {
  const std::string prefix = "--" + name + "=";
  for (int i = 2; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) return argv[i] + prefix.size();
  }
  return fallback;
}

// Every "--name=value" among the arguments, in order.
std::vector<std::string> options_named(int argc, char** argv, const std::string& name) {
  const std::string prefix = "--" + name + "=";
  std::vector<std::string> values;
  for (int i = 2; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) values.emplace_back(argv[i] + prefix.size());
  }
  return values;
}

}  // namespace

int main(int argc, char** argv) {
  // One benchmark per process, so that each peak resident memory is its own.
  const std::string which = argc > 1 ? argv[1] : "";
  bool quick = false;
  for (int i = 2; i < argc; ++i) quick = quick || std::strcmp(argv[i], "--quick") == 0;
  const TrainingOptions options{.precision = option(argc, argv, "precision", "float32"),
                                .checkpoint_every = std::stoll(option(argc, argv, "checkpoint-every", "0")),
                                .finetune = option(argc, argv, "finetune", "full"),
                                .adapter_rank = std::stoll(option(argc, argv, "adapter-rank", "8")),
                                .frozen_weights = option(argc, argv, "frozen-weights", "float32"),
                                .fused_adamw_on_cuda = option(argc, argv, "fused-adamw", "off") == "on",
                                .device = resolve_device(option(argc, argv, "device", "cpu"), "dalle_bench_prior"),
                                .peak_tflops = std::stod(option(argc, argv, "peak-tflops", "989"))};
  const bool cuda_graphs = option(argc, argv, "cuda-graphs", "on") != "off";
  if (which == "attention") {
    attention(256, 512, 8, quick ? 1 : 5);
  } else if (which == "generation") {
    auto config = tiny();
    config.grid_size = 32;
    config.text_length = 32;
    generation(config, 4, "tiny, 32x32 grid");
  } else if (which == "generation-xl") {
    generation_at_layout(rudalle_xl_slice(24), std::stoll(option(argc, argv, "batch", "1")),
                         std::stoll(option(argc, argv, "tokens", quick ? "4" : "32")),
                         option(argc, argv, "dtype", "float32"), options.device, "ruDALL-E Malevich (XL) layout",
                         cuda_graphs);
  } else if (which == "generation-mega") {
    const bool mini = option(argc, argv, "model", "mega") == "mini";
    generation_mega(mini ? models::dalle_mini_config() : models::dalle_mega_config(),
                    std::stoll(option(argc, argv, "images", "1")),
                    std::stoll(option(argc, argv, "tokens", quick ? "4" : "16")),
                    option(argc, argv, "dtype", "float32"),
                    resolve_device(option(argc, argv, "device", "cpu"), "dalle_bench_prior"),
                    mini ? "DALL-E Mini layout" : "DALL-E Mega layout", cuda_graphs);
  } else if (which == "grid-mega") {
    grid_mega(std::stoll(option(argc, argv, "images", "9")), option(argc, argv, "dtype", "float32"),
              resolve_device(option(argc, argv, "device", "cpu"), "dalle_bench_prior"), cuda_graphs);
  } else if (which == "training-tiny") {
    training(tiny(), 32, quick ? 2 : 20, "tiny (fashion-compose)", options);
  } else if (which == "data-parallel") {
    const int64_t ranks = std::stoll(option(argc, argv, "ranks", "1"));
    const bool sharded = option(argc, argv, "sharding", "none") == "within_node";
    const std::vector<std::string> arguments(argv, argv + argc);
    LinkOptions link{.overlap = option(argc, argv, "overlap", "1") != "0",
                     .prefetch_before_gradients = option(argc, argv, "backward-prefetch", "before") != "after",
                     .bucket_bytes = std::llround(std::stod(option(argc, argv, "bucket-mb", "25")) * (1 << 20)),
                     .comm_ratio = std::stod(option(argc, argv, "comm-ratio", "0"))};
    if (const auto fixed = option(argc, argv, "simulate-link", ""); !fixed.empty()) {
      link.link = distributed::parse_simulated_link(fixed);
    }
    link.link.latency_ms = std::max(link.link.latency_ms, std::stod(option(argc, argv, "latency-ms", "0")));
    if (option(argc, argv, "model", "tiny") == "xl-slice") {
      const int64_t layers = std::stoll(option(argc, argv, "layers", "4"));
      data_parallel(rudalle_xl_slice(layers), 2, 1, "ruDALL-E XL layout, " + std::to_string(layers) + "-layer slice",
                    arguments, ranks, sharded, link);
    } else {
      data_parallel(tiny(), 32, quick ? 2 : 20, "tiny (fashion-compose)", arguments, ranks, sharded, link);
    }
  } else if (which == "powersgd-compression") {
    auto xl = rudalle_xl_slice(24);
    for (const int64_t rank : {128, 256, 512}) powersgd_compression(xl, rank, 8, "ruDALL-E XL (1.3B)");
    // The paper's 12B: 64 layers, d_model 3968, 62 heads of 64, rank 896.
    auto twelve = rudalle_xl_slice(64);
    twelve.width = 3968;
    twelve.heads = 62;
    twelve.text_length = 256;
    for (const int64_t rank : {512, 896}) powersgd_compression(twelve, rank, 8, "DALL-E 12B");
  } else if (which == "powersgd-qr") {
    powersgd_qr(quick ? 1 : 3);
  } else if (which == "trainer") {
    const auto path = option(argc, argv, "config", "configs/prior/rudalle-xl.yaml");
    auto source = ConfigSource::from_file(path);
    source.set_all(options_named(argc, argv, "set"));
    trainer_steps(load_config<train::PriorTrainConfig>(source), path, std::stoll(option(argc, argv, "steps", "3")),
                  std::stod(option(argc, argv, "gpu-memory", "16")), options);
  } else if (which == "training-xl-slice") {
    const int64_t layers = std::stoll(option(argc, argv, "layers", "2"));
    auto slice = rudalle_xl_slice(layers);
    slice.attention_path = option(argc, argv, "path", "sparse");
    training(slice, std::stoll(option(argc, argv, "batch", "1")),
             std::stoi(option(argc, argv, "steps", quick ? "1" : "2")),
             "ruDALL-E XL layout, " + std::to_string(layers) + "-layer " + (layers == 24 ? "whole" : "slice"), options);
  } else {
    std::fprintf(stderr,
                 "usage: dalle_bench_prior attention|generation|generation-xl|generation-mega|grid-mega|training-tiny|"
                 "training-xl-slice|trainer|"
                 "data-parallel|"
                 "powersgd-compression|powersgd-qr "
                 "[--quick] [--path=sparse|dense] [--precision=float32|bfloat16|float16] [--checkpoint-every=K] "
                 "[--ranks=N] [--sharding=none|within_node] [--model=tiny|xl-slice|mega|mini] [--layers=L] [--steps=N] "
                 "[--dtype=float32|bfloat16|float16|int8 (CPU)] [--batch=B] [--images=N] [--tokens=N] [--device=cpu|cuda] "
                 "[--peak-tflops=989] [--fused-adamw=on (CUDA)] [--config=RECIPE --set=key=value... --gpu-memory=16 "
                 "(trainer)]\n");
    return 2;
  }
  return 0;
}
