// Mixed precision and memory: per-resblock fp16 gradient scaling, bf16 Adam moments and
// activation checkpointing, each against its fp32 reference.
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <vector>

#include "dalle/models/prior.h"
#include "dalle/train/activation_checkpoint.h"
#include "dalle/train/adamw.h"
#include "dalle/train/gradient_scaler.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/resblock_runner.h"
#include "dalle/train/trainable.h"
#include "test_support.h"

namespace dalle::train {
namespace {

using models::ResblockContext;

// An MLP resblock whose branch is multiplied, in fp32, by a fixed factor: every gradient in
// the block is that factor times O(1), so that a stack of them spans a chosen range.
class AttenuatedMlp : public models::ResblockImpl {
 public:
  AttenuatedMlp(int64_t width, double factor) : factor_(factor) {
    fc_in_ = register_module("fc_in", torch::nn::Linear(width, 2 * width));
    fc_out_ = register_module("fc_out", torch::nn::Linear(2 * width, width));
  }
  torch::Tensor branch(const torch::Tensor& x, const ResblockContext&) override {
    const auto normalized = torch::layer_norm(x, {x.size(-1)});  // as a resblock: O(1) inputs at any depth
    return fc_out_(torch::gelu(fc_in_(normalized))).to(torch::kFloat32) * factor_;
  }

 private:
  double factor_;
  torch::nn::Linear fc_in_{nullptr}, fc_out_{nullptr};
};

// Factors 2^12, 2^7, ..., 2^-28: gradients over 40 octaves, all of fp16's range. The
// gradient entering every block is the same, so one scale for all must keep the loudest
// block from overflowing and lets the quietest underflow.
Resblocks attenuated_stack(int64_t depth, int64_t width) {
  torch::manual_seed(0);
  Resblocks blocks;
  for (int64_t k = 0; k < depth; ++k) {
    blocks.push_back(std::make_shared<AttenuatedMlp>(width, std::exp2(12.0 - 5.0 * static_cast<double>(k))));
  }
  return blocks;
}

// Backward of sum(stack(x) * direction) through `runner` (none: plain fp32).
void backward_through(const Resblocks& blocks, const models::ResblockRunner& runner) {
  torch::manual_seed(1);
  auto x = torch::randn({16, 8});
  const auto direction = torch::randn({16, 8});
  for (const auto& block : blocks) {
    block->zero_grad();
    x = runner ? runner(*block, x, {}) : x + block->branch(x, {});
  }
  (x * direction).sum().backward();
}

// Every block's gradients, one flat tensor each.
std::vector<torch::Tensor> block_gradients(const Resblocks& blocks) {
  std::vector<torch::Tensor> gradients;
  for (const auto& block : blocks) {
    std::vector<torch::Tensor> flat;
    for (const auto& parameter : block->parameters()) flat.push_back(parameter.grad().flatten().clone());
    gradients.push_back(torch::cat(flat));
  }
  return gradients;
}

double relative_error(const torch::Tensor& value, const torch::Tensor& reference) {
  return ((value - reference).norm() / reference.norm()).item<double>();
}

double fraction_zeroed(const torch::Tensor& value, const torch::Tensor& reference) {
  return ((value == 0) & (reference != 0)).to(torch::kFloat64).mean().item<double>();
}

GradientScalingConfig fixed_scale(double log2_scale) {
  return {.initial_log2 = log2_scale, .min_log2 = -20, .max_log2 = 40, .growth_log2 = 0, .backoff_log2 = 0};
}

TEST(ResblockGradientScaling, PerResblockScalesRecoverWhatOneScaleLoses) {
  const auto blocks = attenuated_stack(9, 8);
  backward_through(blocks, nullptr);
  const auto reference = block_gradients(blocks);

  // One scale for every block: the largest power of two at which no gradient overflows.
  std::vector<torch::Tensor> single;
  double single_log2 = 24;
  for (; single_log2 >= -10; --single_log2) {
    GradientScaler scaler(fixed_scale(single_log2), resblock_parameter_groups(blocks));
    backward_through(blocks, make_training_runner(blocks, {.precision = Precision::fp16, .scaler = &scaler}));
    if (scaler.unscale_and_update(scaler.finite_flags())) {
      single = block_gradients(blocks);
      break;
    }
  }
  ASSERT_FALSE(single.empty());
  const auto deepest = blocks.size() - 1;
  EXPECT_GT(fraction_zeroed(single[deepest], reference[deepest]), 0.5) << "one scale should lose the deepest block";
  EXPECT_GT(relative_error(single[deepest], reference[deepest]), 0.5);

  // One scale per block, adapted by the update rule: first with fast constants, so that
  // the scales settle in a few steps, then with DALL-E's slow growth, so that they stop
  // probing the overflow threshold. The lower bound is below DALL-E's 2^7 because the
  // loudest block needs it. Then every block is within fp16's rounding of fp32.
  GradientScalingConfig fast{.initial_log2 = 13, .min_log2 = -10, .growth_log2 = 0.5, .backoff_log2 = 1,
                             .backoff_interval = 0};
  GradientScaler settling(fast, resblock_parameter_groups(blocks));
  for (int step = 0; step < 40; ++step) {
    backward_through(blocks, make_training_runner(blocks, {.precision = Precision::fp16, .scaler = &settling}));
    settling.unscale_and_update(settling.finite_flags());
  }
  auto slow = fast;
  slow.growth_log2 = 1e-3;
  GradientScaler scaler(slow, resblock_parameter_groups(blocks));
  scaler.load_state(settling.state());
  bool finite = false;
  for (int step = 0; step < 10 && !finite; ++step) {
    backward_through(blocks, make_training_runner(blocks, {.precision = Precision::fp16, .scaler = &scaler}));
    finite = scaler.unscale_and_update(scaler.finite_flags());
  }
  ASSERT_TRUE(finite);
  const auto scaled = block_gradients(blocks);
  double worst = 0;
  for (size_t k = 0; k < blocks.size(); ++k) {
    worst = std::max(worst, relative_error(scaled[k], reference[k]));
    EXPECT_LT(relative_error(scaled[k], reference[k]), 1e-2) << "block " << k << " at scale " << scaler.scale(k);
    EXPECT_EQ(fraction_zeroed(scaled[k], reference[k]), 0.0) << "block " << k;
  }
  std::printf("one scale 2^%g: deepest block %.0f%% zeroed, relative error %.3g; per-resblock scales 2^%g..2^%g: "
              "worst relative error %.2g\n",
              single_log2, 100 * fraction_zeroed(single[deepest], reference[deepest]),
              relative_error(single[deepest], reference[deepest]), std::log2(scaler.summary().min),
              std::log2(scaler.summary().max), worst);
  EXPECT_GT(scaler.scale(deepest), scaler.scale(0) * 1024) << "the deepest block should need the largest scale";
}

TEST(ResblockGradientScaling, IdentityStreamKeepsFp32) {
  const auto blocks = attenuated_stack(2, 8);
  GradientScaler scaler(fixed_scale(0), resblock_parameter_groups(blocks));
  const auto runner = make_training_runner(blocks, {.precision = Precision::fp16, .scaler = &scaler});
  const auto input = torch::randn({4, 8});
  auto x = input.clone().requires_grad_(true);
  const auto y = runner(*blocks[1], runner(*blocks[0], x, {}), {});
  EXPECT_EQ(y.scalar_type(), torch::kFloat32);
  y.sum().backward();
  EXPECT_EQ(x.grad().scalar_type(), torch::kFloat32);
  auto reference = input.clone().requires_grad_(true);
  auto z = reference + blocks[0]->branch(reference, {});
  (z + blocks[1]->branch(z, {})).sum().backward();
  EXPECT_LT(relative_error(x.grad(), reference.grad()), 1e-2) << "the block's share comes back unscaled";
}

TEST(GradientScaler, UpdateRuleGrowsBacksOffAtMostOncePerIntervalAndClamps) {
  auto finite = torch::zeros({2}, torch::requires_grad());
  auto broken = torch::zeros({2}, torch::requires_grad());
  GradientScaler scaler({.initial_log2 = 13, .min_log2 = 12, .max_log2 = 14, .growth_log2 = 0.25,
                         .backoff_log2 = 0.5, .backoff_interval = 3},
                        {{finite}, {broken}}, /*replicas=*/4);
  EXPECT_DOUBLE_EQ(scaler.scale(0), 4 * 8192.0);
  auto backward = [&](double broken_value) {
    finite.mutable_grad() = torch::full({2}, 2.0);
    broken.mutable_grad() = torch::full({2}, broken_value);
  };
  backward(INFINITY);
  EXPECT_FALSE(scaler.unscale_and_update(scaler.finite_flags()));
  EXPECT_DOUBLE_EQ(scaler.scale(0), 4 * std::exp2(13.25));
  EXPECT_DOUBLE_EQ(scaler.scale(1), 4 * std::exp2(12.5));
  EXPECT_TRUE(torch::equal(finite.grad(), torch::zeros({2}))) << "a skipped update leaves no gradient behind";
  backward(NAN);  // within the interval: skipped, but no second division
  EXPECT_FALSE(scaler.unscale_and_update(scaler.finite_flags()));
  EXPECT_DOUBLE_EQ(scaler.scale(1), 4 * std::exp2(12.5));
  backward(1.0);
  EXPECT_TRUE(scaler.unscale_and_update(scaler.finite_flags()));
  EXPECT_TRUE(torch::allclose(finite.grad(), torch::full({2}, 2.0 / (4 * std::exp2(13.5)))));
  EXPECT_DOUBLE_EQ(scaler.scale(1), 4 * std::exp2(12.75));
  backward(INFINITY);  // three updates after the first division: divided again, then clamped
  EXPECT_FALSE(scaler.unscale_and_update(scaler.finite_flags()));
  EXPECT_DOUBLE_EQ(scaler.scale(1), 4 * std::exp2(12.25));
  for (int i = 0; i < 8; ++i) {
    backward(1.0);
    scaler.unscale_and_update(scaler.finite_flags());
  }
  EXPECT_DOUBLE_EQ(scaler.scale(0), 4 * std::exp2(14.0));
  EXPECT_EQ(scaler.skipped_updates(), 3);
  EXPECT_DOUBLE_EQ(scaler.summary().max, 4 * std::exp2(14.0));

  GradientScaler restored({}, {{finite}, {broken}});
  restored.load_state(scaler.state());
  EXPECT_EQ(restored.scale(1), scaler.scale(1));
  EXPECT_EQ(restored.skipped_updates(), 3);
  GradientScaler other({}, {{finite}});
  EXPECT_THROW(other.load_state(scaler.state()), Error);
}

models::PriorConfig tiny_prior(double dropout) {
  return {.text_length = 6, .text_vocab_size = 24, .grid_size = 4, .image_vocab_size = 16, .layers = 3, .width = 32,
          .heads = 2, .conv_kernel = 3, .dropout = dropout};
}

torch::Tensor tiny_tokens() {
  torch::manual_seed(3);
  return torch::cat({torch::randint(1, 24, {4, 6}), torch::randint(0, 16, {4, 16})}, 1);
}

// The gradients of one training step, the generator's state after it, and the loss.
struct StepResult {
  std::vector<torch::Tensor> gradients;
  torch::Tensor generator_state;
  double loss = 0;
};

StepResult training_step(models::Prior& prior, const models::ResblockRunner& runner) {
  prior->set_resblock_runner(runner);
  prior->train();
  prior->zero_grad();
  const auto tokens = tiny_tokens();
  torch::manual_seed(4);
  const auto loss = models::prior_loss(prior->forward(tokens), tokens, prior->config()).total;
  loss.backward();
  StepResult result{{}, at::detail::getDefaultCPUGenerator().get_state(), loss.item<double>()};
  for (const auto& parameter : prior->parameters()) {
    result.gradients.push_back(parameter.grad().defined() ? parameter.grad().clone() : torch::Tensor());
  }
  return result;
}

TEST(ActivationCheckpointing, GradientsAreIdenticalWithDropout) {
  torch::manual_seed(0);
  models::Prior prior(tiny_prior(/*dropout=*/0.2));
  const auto plain = training_step(prior, nullptr);
  for (int64_t every : {1, 2}) {
    const auto checkpointed_step =
        training_step(prior, make_training_runner(prior->resblocks(), {.checkpoint_every = every}));
    EXPECT_EQ(checkpointed_step.loss, plain.loss);
    ASSERT_EQ(checkpointed_step.gradients.size(), plain.gradients.size());
    for (size_t i = 0; i < plain.gradients.size(); ++i) {
      EXPECT_TRUE(torch::equal(checkpointed_step.gradients[i], plain.gradients[i]))
          << "every " << every << ", parameter " << i;
    }
    EXPECT_TRUE(torch::equal(checkpointed_step.generator_state, plain.generator_state))
        << "the rerun must leave the generator where the first run did";
  }
}

TEST(ActivationCheckpointing, Fp16GradientsAreIdenticalToo) {
  torch::manual_seed(0);
  models::Prior prior(tiny_prior(/*dropout=*/0.0));
  GradientScaler scaler(fixed_scale(12), resblock_parameter_groups(prior->resblocks()));
  const auto plain =
      training_step(prior, make_training_runner(prior->resblocks(), {.precision = Precision::fp16, .scaler = &scaler}));
  const auto checkpointed_step = training_step(
      prior, make_training_runner(prior->resblocks(),
                                  {.precision = Precision::fp16, .scaler = &scaler, .checkpoint_every = 1}));
  for (size_t i = 0; i < plain.gradients.size(); ++i) {
    EXPECT_TRUE(torch::equal(checkpointed_step.gradients[i], plain.gradients[i])) << "parameter " << i;
  }
}

// Behind frozen layers (adapters after frozen embeddings) a block's input needs no gradient,
// yet a checkpointed block's parameters get theirs: here block 0 is frozen too and is simply
// run, blocks 1 and 2 train, and the gradients are those of the plain step.
TEST(ActivationCheckpointing, BlocksBehindFrozenLayersGetTheirGradients) {
  torch::manual_seed(0);
  models::Prior prior(tiny_prior(/*dropout=*/0.2));
  for (auto& item : prior->named_parameters()) {
    item.value().requires_grad_(item.key().starts_with("resblocks.1.") || item.key().starts_with("resblocks.2."));
  }
  const auto plain = training_step(prior, nullptr);
  const auto checkpointed_step =
      training_step(prior, make_training_runner(prior->resblocks(), {.checkpoint_every = 1}));
  EXPECT_EQ(checkpointed_step.loss, plain.loss);
  const auto names = prior->named_parameters().keys();
  for (size_t i = 0; i < plain.gradients.size(); ++i) {
    const bool trains = names[i].starts_with("resblocks.1.") || names[i].starts_with("resblocks.2.");
    ASSERT_EQ(plain.gradients[i].defined(), trains) << names[i];
    ASSERT_EQ(checkpointed_step.gradients[i].defined(), trains) << names[i];
    if (trains) {
      EXPECT_TRUE(torch::equal(checkpointed_step.gradients[i], plain.gradients[i])) << names[i];
    }
  }
  // checkpointed() itself: an input without gradient still trains the function's parameters.
  torch::nn::Linear linear(4, 4);
  const auto input = torch::randn({2, 4});
  linear(input).square().sum().backward();
  const auto expected = linear->weight.grad().clone();
  linear->zero_grad();
  checkpointed([&](const torch::Tensor& x) { return linear(x); }, input).square().sum().backward();
  EXPECT_TRUE(torch::allclose(linear->weight.grad(), expected));
}

// checkpointed_inputs: a checkpointed function keeps its input in 16 bits. Its forward is
// the exact one; its backward is exactly the plain backward of the function at the rounded
// input (the recomputation's start), and no longer the float32 one's.
TEST(ActivationCheckpointing, SixteenBitKeptInputsRecomputeFromTheRoundedInput) {
  torch::manual_seed(0);
  torch::nn::Linear linear(8, 8);
  const auto fn = [&](const torch::Tensor& x) { return x + torch::tanh(linear(x)); };
  const auto input = (torch::randn({3, 8}) * 3).requires_grad_(true);
  const auto upstream = torch::randn({3, 8});
  const auto gradients = [&](const torch::Tensor& output) {
    linear->zero_grad();
    if (input.grad().defined()) input.mutable_grad().zero_();
    output.backward(upstream);
    return std::pair{input.grad().clone(), linear->weight.grad().clone()};
  };
  for (const auto kept_as : {torch::kBFloat16, torch::kFloat16}) {
    const auto output = checkpointed(fn, input, kept_as);
    EXPECT_TRUE(torch::equal(output, fn(input).detach())) << "the forward uses the exact input";
    const auto [input_grad, weight_grad] = gradients(output);
    const auto rounded = input.detach().to(kept_as).to(torch::kFloat32).requires_grad_(true);
    linear->zero_grad();
    fn(rounded).backward(upstream);
    EXPECT_TRUE(torch::equal(input_grad, rounded.grad())) << kept_as;
    EXPECT_TRUE(torch::equal(weight_grad, linear->weight.grad())) << kept_as;
    const auto [exact_input_grad, exact_weight_grad] = gradients(checkpointed(fn, input));
    EXPECT_FALSE(torch::equal(weight_grad, exact_weight_grad)) << "a float32 kept input is the exact one";
    EXPECT_TRUE(torch::equal(kept_input(input, kept_as), input.detach().to(kept_as)));
  }
  EXPECT_TRUE(kept_input(input, torch::kFloat32).is_same(input)) << "float32 keeps x itself, no copy";
}

TEST(MixedPrecision, Fp16AndBf16StepsFollowFp32) {
  torch::manual_seed(0);
  models::Prior prior(tiny_prior(/*dropout=*/0.0));
  const auto reference = training_step(prior, nullptr);
  GradientScaler scaler(fixed_scale(13), resblock_parameter_groups(prior->resblocks()));
  const auto fp16 =
      training_step(prior, make_training_runner(prior->resblocks(), {.precision = Precision::fp16, .scaler = &scaler}));
  ASSERT_TRUE(scaler.unscale_and_update(scaler.finite_flags()));
  std::vector<torch::Tensor> fp16_gradients;
  for (const auto& parameter : prior->parameters()) fp16_gradients.push_back(parameter.grad().clone());
  const auto bf16 = training_step(prior, make_training_runner(prior->resblocks(), {.precision = Precision::bf16}));
  EXPECT_NEAR(fp16.loss, reference.loss, 1e-2 * reference.loss);
  EXPECT_NEAR(bf16.loss, reference.loss, 2e-2 * reference.loss);
  const auto flat = [](const std::vector<torch::Tensor>& tensors) {
    std::vector<torch::Tensor> flat;
    for (const auto& t : tensors) flat.push_back(t.flatten());
    return torch::cat(flat);
  };
  EXPECT_LT(relative_error(flat(fp16_gradients), flat(reference.gradients)), 2e-2);
  EXPECT_LT(relative_error(flat(bf16.gradients), flat(reference.gradients)), 5e-2);
  for (const auto& parameter : prior->parameters()) EXPECT_EQ(parameter.grad().scalar_type(), torch::kFloat32);
}

// Ten updates of a linear layer by torch's AdamW (its tensor-by-tensor loop) and by ours,
// with fp32 and bf16 moments, on `device`: ours returned beside the reference.
struct AdamWRuns {
  torch::nn::Linear reference{nullptr}, fp32{nullptr}, bf16{nullptr};
  std::unique_ptr<AdamW> fp32_adamw, bf16_adamw;
};
AdamWRuns adamw_runs(const torch::Device& device, bool fuse_on_cuda) {
  auto make = [&] {
    torch::manual_seed(0);
    torch::nn::Linear linear(16, 8);
    linear->to(device);
    return linear;
  };
  AdamWRuns runs{make(), make(), make()};
  const auto options = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.96}).weight_decay(0.05);
  torch::optim::AdamW torch_adamw(runs.reference->parameters(), options);
  runs.fp32_adamw = std::make_unique<AdamW>(
      std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(runs.fp32->parameters())},
      options);
  runs.fp32_adamw->fuse_on_cuda(fuse_on_cuda);
  runs.bf16_adamw = std::make_unique<AdamW>(
      std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(runs.bf16->parameters())},
      options, torch::kBFloat16);
  auto update = [](torch::nn::Linear& linear, torch::optim::Optimizer& optimizer, const torch::Tensor& x) {
    optimizer.zero_grad();
    linear(x).pow(2).mean().backward();
    optimizer.step();
  };
  for (int step = 0; step < 10; ++step) {
    const auto x = torch::randn({4, 16}).to(device);
    update(runs.reference, torch_adamw, x);
    update(runs.fp32, *runs.fp32_adamw, x);
    update(runs.bf16, *runs.bf16_adamw, x);
  }
  return runs;
}

// fp32 state steps through LibTorch's fused kernel on the CPU: torch's AdamW to float32's
// rounding (the kernel orders its arithmetic otherwise), its moments kept where torch keeps them.
TEST(AdamW, Bf16MomentsFollowFp32AndFp32IsTorchsAdamW) {
  const auto runs = adamw_runs(torch::kCPU, false);
  const auto& reference = runs.reference;
  for (size_t i = 0; i < reference->parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(runs.fp32->parameters()[i], reference->parameters()[i], 0, 1e-6));
    EXPECT_FALSE(torch::equal(runs.fp32->parameters()[i], reference->parameters()[i]))
        << "the fused kernel steps the CPU's float32 state, not torch's loop";
    EXPECT_TRUE(torch::allclose(runs.bf16->parameters()[i], reference->parameters()[i], 1e-2, 2e-3));
    EXPECT_FALSE(torch::equal(runs.bf16->parameters()[i], reference->parameters()[i])) << "bf16 moments should round";
  }
  const auto& fused = static_cast<const torch::optim::AdamWParamState&>(
      *runs.fp32_adamw->state().at(runs.fp32->parameters()[0].unsafeGetTensorImpl()));
  EXPECT_EQ(fused.step(), 10);
  EXPECT_EQ(fused.exp_avg().scalar_type(), torch::kFloat32);
  EXPECT_GT(fused.exp_avg_sq().abs().sum().item<double>(), 0.0);
  const auto& state = static_cast<const torch::optim::AdamWParamState&>(
      *runs.bf16_adamw->state().at(runs.bf16->parameters()[0].unsafeGetTensorImpl()));
  EXPECT_EQ(state.exp_avg().scalar_type(), torch::kBFloat16);
  EXPECT_EQ(state.exp_avg_sq().scalar_type(), torch::kBFloat16);
  EXPECT_EQ(state.step(), 10);
}

// The fused kernel on CUDA (asked for: it is not yet the default there) steps as torch's loop
// does on the same GPU. scripts/device/gpu-check runs it.
TEST(AdamW, FusedOnCudaStepsAsTorchsLoop) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "torch sees no CUDA device";
  const auto runs = adamw_runs(torch::kCUDA, true);
  for (size_t i = 0; i < runs.reference->parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(runs.fp32->parameters()[i], runs.reference->parameters()[i], 0, 1e-6));
  }
  const auto& fused = static_cast<const torch::optim::AdamWParamState&>(
      *runs.fp32_adamw->state().at(runs.fp32->parameters()[0].unsafeGetTensorImpl()));
  EXPECT_EQ(fused.step(), 10);
  EXPECT_TRUE(fused.exp_avg().is_cuda());
}

// optimizer.trainable: the patterns freeze the rest, and what the update step reduces and
// checks (ModelPrecision::parameters, the gradient reducer's list) holds the trained alone.
TEST(Trainable, PatternsFreezeTheRestAndTheReducedParametersAreTheTrainedOnes) {
  torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})),
                              torch::nn::Linear(4, 2));
  EXPECT_EQ(freeze_all_but(*model, {}, "test"), 6) << "no patterns: everything trains";
  EXPECT_EQ(freeze_all_but(*model, {"1.*", "2.bias"}, "test"), 3);
  const auto named = model->named_parameters();
  EXPECT_FALSE(named["0.weight"].requires_grad());
  EXPECT_TRUE(named["1.weight"].requires_grad() && named["2.bias"].requires_grad());
  EXPECT_FALSE(named["2.weight"].requires_grad());
  const ModelPrecision precision(PrecisionConfig{}, model->parameters(), 1);
  ASSERT_EQ(precision.parameters().size(), 3u);
  EXPECT_TRUE(precision.parameters()[0].is_same(named["1.weight"]));
  model->forward(torch::randn({3, 4})).sum().backward();
  EXPECT_FALSE(named["0.weight"].grad().defined()) << "no gradient is computed for a frozen parameter";
  EXPECT_TRUE(named["2.bias"].grad().defined());
  EXPECT_THROW_WITH(freeze_all_but(*model, {"3.*"}, "test"), Error, "\"3.*\" matches no parameter");
}

}  // namespace
}  // namespace dalle::train
