#include "dalle/train/update_step.h"

#include <torch/torch.h>

#include <limits>
#include <utility>

#include "dalle/train/adamw.h"
#include "test_support.h"

namespace dalle::train {
namespace {

// A linear model whose gradient of sum(w * x) is x: known in advance.
struct Fixture {
  torch::nn::Linear model{torch::nn::LinearOptions(3, 1).bias(false)};
  torch::optim::SGD optimizer{model->parameters(), torch::optim::SGDOptions(1.0)};

  Fixture() {
    torch::NoGradGuard no_grad;
    model->weight.fill_(1.0);
  }
  torch::Tensor loss(const torch::Tensor& input) { return model->forward(input.reshape({1, 3})).sum(); }
  torch::Tensor weight() const { return model->weight.detach().clone().flatten(); }
};

PrecisionConfig fp16() {
  PrecisionConfig config;
  config.mode = "float16";
  return config;
}

// Records what the gradients are when each part of the reducer is called, and may veto the update.
class RecordingReducer final : public distributed::GradientReducer {
 public:
  void before_backward(const std::vector<torch::Tensor>& parameters) override {
    named_before_backward = parameters.size();
    for (const auto& parameter : parameters) gradient_before_backward |= parameter.grad().defined();
  }
  void reduce_scaled(const std::vector<torch::Tensor>& parameters) override {
    agreed_before_scaled = agreed_on.defined();
    for (const auto& parameter : parameters) seen_scaled.push_back(parameter.grad().clone());
  }
  void reduce_unscaled(const std::vector<torch::Tensor>& parameters) override {
    agreed_before_reduce = agreed_on.defined();
    for (const auto& parameter : parameters) seen.push_back(parameter.grad().clone());
    for (const auto& parameter : parameters) parameter.grad().mul_(0.5);  // as a mean with a zero replica
  }
  torch::Tensor agree(const torch::Tensor& flags) override {
    agreed_on = flags.clone();
    return veto ? torch::zeros_like(flags) : flags;
  }
  int64_t replicas() const override { return 2; }

  std::vector<torch::Tensor> seen, seen_scaled;
  torch::Tensor agreed_on;
  size_t named_before_backward = 0;
  bool gradient_before_backward = false, agreed_before_scaled = false, agreed_before_reduce = false;
  bool veto = false;
};

TEST(UpdateStep, StepsWithTheGradientAndAveragesTheWeights) {
  Fixture f;
  ModelPrecision precision(PrecisionConfig{}, f.model->parameters());
  Ema ema(*f.model, 0.5);
  UpdateStep update(f.optimizer, precision, {.what = "test"}, &ema, f.model.get());
  const auto result = update.apply(f.loss(torch::tensor({1.0, 2.0, 3.0})), 1);
  EXPECT_FALSE(result.skipped);
  EXPECT_TRUE(torch::equal(f.weight(), torch::tensor({0.0, -1.0, -2.0})));
  // The average moved halfway from 1 towards the new weights.
  EXPECT_TRUE(torch::allclose(ema.weights().at("weight").flatten(), torch::tensor({0.5, 0.0, -0.5})));
}

// The reducer hears of the parameters before backward (to overlap), finishes what may see
// scaled gradients before the flags are agreed on, and sees unscaled gradients after
// (PowerSGD's error feedback must not carry one update's fp16 scale into the next).
TEST(UpdateStep, TheReducerSeesUnscaledGradientsOnceTheFlagsAgreeAndItsResultIsWhatSteps) {
  Fixture f;
  ModelPrecision precision(fp16(), f.model->parameters());
  UpdateStep update(f.optimizer, precision, {.what = "test"});
  auto reducer = std::make_shared<RecordingReducer>();
  update.set_reducer(reducer);
  const double scale = precision.scale();
  ASSERT_GT(scale, 1.0);
  update.apply(f.loss(torch::tensor({1.0, 2.0, 3.0})), 1);
  EXPECT_EQ(reducer->named_before_backward, 1u);
  EXPECT_FALSE(reducer->gradient_before_backward) << "named after zero_grad";
  ASSERT_EQ(reducer->seen_scaled.size(), 1u);
  EXPECT_TRUE(torch::allclose(reducer->seen_scaled[0].flatten(), torch::tensor({1.0, 2.0, 3.0}) * scale));
  EXPECT_FALSE(reducer->agreed_before_scaled);
  ASSERT_EQ(reducer->seen.size(), 1u);
  EXPECT_TRUE(torch::allclose(reducer->seen[0].flatten(), torch::tensor({1.0, 2.0, 3.0})));
  EXPECT_TRUE(reducer->agreed_before_reduce);
  EXPECT_EQ(reducer->agreed_on.numel(), 1);
  // The reducer halved the gradient, and that is what stepped.
  EXPECT_TRUE(torch::allclose(f.weight(), torch::tensor({0.5, 0.0, -0.5})));
}

TEST(UpdateStep, AVetoFromTheReplicasSkipsTheUpdateAndBacksOffTheScale) {
  Fixture f;
  ModelPrecision precision(fp16(), f.model->parameters());
  Ema ema(*f.model, 0.5);
  UpdateStep update(f.optimizer, precision, {.what = "test"}, &ema, f.model.get());
  auto reducer = std::make_shared<RecordingReducer>();
  reducer->veto = true;
  update.set_reducer(reducer);
  const double scale = precision.scale();
  const auto result = update.apply(f.loss(torch::tensor({1.0, 2.0, 3.0})), 1);
  EXPECT_TRUE(result.skipped);
  EXPECT_TRUE(reducer->seen.empty()) << "a skipped update reduces no more than what backward started";
  EXPECT_TRUE(torch::equal(f.weight(), torch::ones({3})));
  EXPECT_TRUE(torch::equal(ema.weights().at("weight").flatten(), torch::ones({3})));
  EXPECT_LT(precision.scale(), scale);
  EXPECT_EQ(precision.scaler()->skipped_updates(), 1);
}

TEST(UpdateStep, ANonFiniteGradientSkipsInFp32Too) {
  Fixture f;
  ModelPrecision precision(PrecisionConfig{}, f.model->parameters());
  UpdateStep update(f.optimizer, precision, {.what = "test"});
  const double inf = std::numeric_limits<double>::infinity();
  const auto result = update.apply(f.loss(torch::tensor({1.0, inf, 3.0})), 7);
  EXPECT_TRUE(result.skipped);
  EXPECT_TRUE(std::isnan(result.grad_norm));
  EXPECT_TRUE(torch::equal(f.weight(), torch::ones({3})));
}

TEST(UpdateStep, ClipsTheGlobalNormAndReportsItBeforeClipping) {
  Fixture f;
  ModelPrecision precision(PrecisionConfig{}, f.model->parameters());
  UpdateStep update(f.optimizer, precision, {.what = "test", .grad_clip = 2.5});
  const auto result = update.apply(f.loss(torch::tensor({3.0, 4.0, 0.0})), 1);  // norm 5
  EXPECT_NEAR(result.grad_norm, 5.0, 1e-6);
  EXPECT_TRUE(torch::allclose(f.weight(), torch::tensor({1.0 - 1.5, 1.0 - 2.0, 1.0}), 1e-5, 1e-5));
}

TEST(UpdateStep, ConstraintsApplyAfterTheStepAndBeforeTheAverage) {
  Fixture f;
  ModelPrecision precision(PrecisionConfig{}, f.model->parameters());
  Ema ema(*f.model, 0.0);  // the average is the latest weights
  UpdateStep update(f.optimizer, precision,
                    {.what = "test",
                     .after_step = [&f] {
                       torch::NoGradGuard no_grad;
                       f.model->weight.clamp_(-0.5, 0.5);
                     }},
                    &ema, f.model.get());
  update.apply(f.loss(torch::tensor({1.0, 2.0, 3.0})), 1);
  EXPECT_TRUE(torch::equal(f.weight(), torch::tensor({0.0, -0.5, -0.5})));
  EXPECT_TRUE(torch::equal(ema.weights().at("weight").flatten(), torch::tensor({0.0, -0.5, -0.5})));
}

TEST(UpdateStep, GradientsOutsideTheScaleGroupsAreCheckedByTheNorm) {
  // The prior's layout: the scaler covers the resblocks, the embeddings come out unscaled.
  torch::nn::Linear grouped(torch::nn::LinearOptions(2, 1).bias(false)), outside(torch::nn::LinearOptions(2, 1).bias(false));
  std::vector<torch::Tensor> all = grouped->parameters();
  all.push_back(outside->weight);
  torch::optim::SGD optimizer(all, torch::optim::SGDOptions(1.0));
  ModelPrecision precision(fp16(), all, {grouped->parameters()});
  UpdateStep update(optimizer, precision, {.what = "test", .measure_norm = true});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const auto before = outside->weight.detach().clone();
  const auto loss = grouped->forward(torch::ones({1, 2})).sum() + outside->forward(torch::tensor({{nan, 1.0}})).sum();
  EXPECT_TRUE(update.apply(loss, 1).skipped);
  EXPECT_TRUE(torch::equal(outside->weight.detach(), before));
}

// A reducer that keeps a gradient from update to update (as ShardedReducer keeps PowerSGD's
// error feedback as the gradient) and keeps the reduced one until the optimizer takes it.
class KeepingReducer final : public distributed::GradientReducer {
 public:
  explicit KeepingReducer(torch::Tensor parameter) : parameter_(std::move(parameter)) {}
  void before_backward(const std::vector<torch::Tensor>&) override { parameter_.mutable_grad() = held.clone(); }
  void reduce_scaled(const std::vector<torch::Tensor>&) override {}
  void reduce_unscaled(const std::vector<torch::Tensor>&) override {
    kept = parameter_.grad();
    parameter_.mutable_grad() = torch::Tensor();
  }
  torch::Tensor agree(const torch::Tensor& flags) override { return flags; }
  int64_t replicas() const override { return 1; }
  bool keeps_gradients() const override { return kept.defined(); }
  torch::Tensor take_gradient(const torch::Tensor& parameter, double factor) override {
    if (!parameter.is_same(parameter_) || !kept.defined()) return {};
    return std::exchange(kept, torch::Tensor()) * factor;
  }

  torch::Tensor held = torch::tensor({{10.0, 20.0, 30.0}}), kept;

 private:
  torch::Tensor parameter_;
};

// In fp16 the gradient a reducer holds before backward is brought to the backward's scale,
// so that backward adds to it and unscaling gives held + this update's gradient; AdamW takes
// the gradient the reducer kept as it steps (its first moment is 0.1 x that gradient), and an
// optimizer that cannot take one is refused.
TEST(UpdateStep, AGradientHeldBeforeBackwardIsScaledAndTheOptimizerTakesWhatTheReducerKeeps) {
  Fixture f;
  ModelPrecision precision(fp16(), f.model->parameters());
  ASSERT_GT(precision.scale(), 1.0);
  AdamW adamw(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(f.model->parameters())},
              torch::optim::AdamWOptions(0.1).weight_decay(0.0));
  UpdateStep update(adamw, precision, {.what = "test"});
  auto reducer = std::make_shared<KeepingReducer>(f.model->weight);
  update.set_reducer(reducer);
  EXPECT_FALSE(update.apply(f.loss(torch::tensor({1.0, 2.0, 3.0})), 1).skipped);
  EXPECT_FALSE(reducer->keeps_gradients()) << "taken";
  const auto& adam = static_cast<const torch::optim::AdamWParamState&>(
      *adamw.state().at(f.model->weight.unsafeGetTensorImpl()));
  EXPECT_TRUE(torch::allclose(adam.exp_avg().flatten(), torch::tensor({11.0, 22.0, 33.0}) * 0.1));

  Fixture g;
  ModelPrecision sgd_precision(PrecisionConfig{}, g.model->parameters());
  UpdateStep sgd(g.optimizer, sgd_precision, {.what = "test"});
  sgd.set_reducer(std::make_shared<KeepingReducer>(g.model->weight));
  EXPECT_THROW_WITH(sgd.apply(g.loss(torch::tensor({1.0, 2.0, 3.0})), 1), Error, "needs dalle's AdamW");
}

}  // namespace
}  // namespace dalle::train
