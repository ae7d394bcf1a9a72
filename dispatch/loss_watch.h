#pragma once
// What a mean cross-entropy divided by, seen while autograd is off.
//
// The global loss (vescale/global_loss.py) weighs each DP rank's loss by the targets its
// mean cross-entropy averaged over: nll_loss_forward's second result, total_weight. With
// autograd on, the loss's node saved it. Under torch.no_grad() (an evaluation loop) there
// is no node, and the weight was the batch's rows: an evaluation loss over masked or
// padded targets came out unlike one device's. While a watch is on (this thread, one
// forward), a RecordFunction observer keeps each mean nll_loss_forward's output and
// total_weight; the caller then asks for the total of the loss the model returned. Off,
// nothing is registered and no op pays for it.

#include <ATen/ATen.h>

#include <optional>

namespace vescale::loss_watch {

void start();  // on this thread, until stop(); a second start restarts
void stop();   // forgets what was seen
// total_weight of the mean nll_loss_forward (or nll_loss2d_forward) seen since start()
// whose output is `loss` itself (the same tensor, not a value computed from it).
std::optional<at::Tensor> total_of(const at::Tensor& loss);

}  // namespace vescale::loss_watch
