#include "dispatch/loss_watch.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

namespace vescale {
namespace {

at::Tensor masked_targets() {
  auto t = at::arange(6, at::kLong).remainder(4);
  t.index_put_({at::indexing::Slice(0, 2)}, -100);  // two ignored: 4 targets count
  return t;
}

TEST(LossWatch, KeepsWhatAMeanCrossEntropyDividesByWithoutAutograd) {
  c10::AutoGradMode no_grad(false);
  const auto logits = at::randn({6, 4});
  loss_watch::start();
  const auto loss = at::cross_entropy_loss(logits, masked_targets());
  const auto other = loss * 2;  // a value computed from the loss is not the loss
  const auto total = loss_watch::total_of(loss);
  ASSERT_TRUE(total.has_value());
  EXPECT_EQ(total->item<float>(), 4.f);
  EXPECT_FALSE(loss_watch::total_of(other).has_value());
  loss_watch::stop();
  EXPECT_FALSE(loss_watch::total_of(loss).has_value());  // stop forgets
}

TEST(LossWatch, SeesNoSumReductionAndNothingWhileOff) {
  c10::AutoGradMode no_grad(false);
  const auto logits = at::randn({6, 4});
  loss_watch::start();
  const auto summed = at::cross_entropy_loss(logits, masked_targets(), {}, at::Reduction::Sum);
  EXPECT_FALSE(loss_watch::total_of(summed).has_value());
  loss_watch::stop();
  const auto unwatched = at::cross_entropy_loss(logits, masked_targets());
  EXPECT_FALSE(loss_watch::total_of(unwatched).has_value());
}

}  // namespace
}  // namespace vescale
