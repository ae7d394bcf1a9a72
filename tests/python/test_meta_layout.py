"""Results laid out as the CPU kernels lay them out, where torch's meta kernels disagree
(dispatch/meta_layout.cpp). A DTensor's strides come from the meta kernel; for these ops
it once said contiguous (or the input's layout) where a plain run's result is not, so
`stride()` differed from one device's and a dropout after the op drew another mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vescale import Replicate, Shard

from dist_utils import make_dtensor, mesh, mismatch, rand

A = torch.ops.aten


def _binary_inputs():
    """(first, second) pairs of the layouts that showed the difference: a transposed value
    beside a contiguous one, and a broadcast of an expanded value against a transposed one."""
    t = rand((5, 4), seed=1).t() + 2.0
    c = rand((4, 5), seed=2) + 2.0
    base = rand((3, 1, 6, 3), seed=3) + 2.0
    return {"transposed": (t, c), "broadcast": (base.expand(2, 3, 1, 6, 3), base.transpose(1, 3)),
            "broadcast_reversed": (base.transpose(1, 3), base.expand(2, 3, 1, 6, 3))}


BINARY = {
    "copysign": torch.copysign, "floor_divide": torch.floor_divide,
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "heaviside": torch.heaviside, "logaddexp": torch.logaddexp, "logaddexp2": torch.logaddexp2,
    "logical_and": lambda a, b: torch.logical_and(a > 2.5, b > 2.5).double(),
    "logical_xor": lambda a, b: torch.logical_xor(a > 2.5, b > 2.5).double(),
    "xlogy": torch.xlogy, "xlog1py": torch.special.xlog1py,
    "dropout_backward": lambda g, x: A.native_dropout_backward(g, x > 2.5, 2.0),
    "hardtanh_backward": lambda g, x: A.hardtanh_backward(g, x - 2.5, -0.2, 0.2),
    "softplus_backward": lambda g, x: A.softplus_backward(g, x, 1.0, 20.0),
    "mse_loss_backward": lambda x, t: A.mse_loss_backward(torch.ones((), dtype=x.dtype), x, t, 1),
    "smooth_l1_loss_backward": lambda x, t: A.smooth_l1_loss_backward(torch.ones((), dtype=x.dtype), x, t, 1, 1.0),
    "huber_loss_backward": lambda x, t: A.huber_loss_backward(torch.ones((), dtype=x.dtype), x, t, 1, 1.0),
    "add": torch.add,  # a control: its meta kernel was right
}

UNARY = {
    "logsigmoid": F.logsigmoid,
    "batch_norm": lambda x: F.batch_norm(x, None, None, training=True),
    "batch_norm_channels_last": lambda x: F.batch_norm(x.contiguous(memory_format=torch.channels_last), None, None,
                                                       training=True),
    "isin": lambda x: torch.isin(x, x.flatten()[:3]).double() + x,
    "log_softmax_backward": lambda x: A._log_softmax_backward_data(x, torch.log_softmax(x, 1), 1, x.dtype),
    "normal_tensors": lambda x: _seeded(lambda: torch.normal(x, x.abs() + 0.1)),
    "normal_std_tensor": lambda x: _seeded(lambda: torch.normal(0.5, x.abs() + 0.1)),
    "poisson": lambda x: _seeded(lambda: torch.poisson(x.abs())),
    # roll on CPU: a channels-last input stays so, any other becomes contiguous; its meta
    # decomposition goes contiguous (chain fuzzer seed 49001738: a roll after an FFT)
    "roll_channels_last": lambda x: torch.roll(x.contiguous(memory_format=torch.channels_last), 1, 1),
    "roll_two_dims_channels_last": lambda x: torch.roll(x.contiguous(memory_format=torch.channels_last),
                                                        (1, -2), (1, 3)),
    "roll_transposed": lambda x: torch.roll(x.transpose(1, 3), 1, 1),
}


def _seeded(draw):
    torch.manual_seed(5)
    return draw()


def _dim_order(t):
    return sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=lambda d: (-t.stride()[d], d))


def _check(out, ref, what, failures):
    if _dim_order(out) != _dim_order(ref):
        failures[f"{what}: strides"] = (tuple(out.stride()), tuple(ref.stride()))
    torch.manual_seed(11)
    dropped = F.dropout(out, 0.3)
    torch.manual_seed(11)
    if (bad := mismatch(dropped.full_tensor(), F.dropout(ref, 0.3))) is not None:
        failures[f"{what}: dropout after it"] = bad


def _case_results_laid_out_as_on_one_device():
    failures = {}
    for mesh_name in ("1d4", "2d"):
        m = mesh(mesh_name)
        for layout, (a, b) in _binary_inputs().items():
            for placement in ([Replicate()], [Shard(a.dim() - 1)]):
                placements = placement * m.ndim
                x = make_dtensor(a, m, placements)
                y = make_dtensor(b, m, [Replicate()] * m.ndim)
                for name, fn in BINARY.items():
                    _check(fn(x, y), fn(a, b), f"{mesh_name} {layout} {placements} {name}", failures)
        x4 = (rand((2, 4, 3, 5), seed=4) + 1).permute(0, 2, 1, 3)  # (2, 3, 4, 5), neither format
        x4 = x4.transpose(1, 2)  # (2, 4, 3, 5) with channels not outermost
        for placements in ([Replicate()] * m.ndim, [Shard(0)] + [Replicate()] * (m.ndim - 1)):
            x = make_dtensor(x4, m, placements)
            for name, fn in UNARY.items():
                _check(fn(x), fn(x4), f"{mesh_name} {placements} {name}", failures)
    return failures


def test_results_laid_out_as_on_one_device(pool4):
    for failures in pool4.run(_case_results_laid_out_as_on_one_device):
        assert failures == {}


def _case_fft_results_laid_out_as_mkl_lays_them_out():
    """torch's meta kernels for FFTs take cuFFT's path on meta tensors; on CPU, MKL orders
    the batch dims by the input's strides and the transformed dims by transform order
    (dispatch/meta_layout.cpp mirrors it). Found by the fifth fuzz table (seed 44001895:
    two rfft filters over a (9, 5, 7, 4) value)."""
    failures = {}
    base = rand((3, 4, 5, 6), seed=5)
    m = mesh("1d4")
    ffts = {
        "rfftn": lambda x, dims: torch.fft.rfftn(x, dim=dims),
        "fftn": lambda x, dims: torch.fft.fftn(x, dim=dims),
        "irfftn": lambda x, dims: torch.fft.irfftn(x, dim=dims),
        "hfft": lambda x, dims: torch.fft.hfft(x, dim=dims[-1]),
    }
    for perm in ((0, 1, 2, 3), (3, 2, 1, 0), (0, 2, 3, 1), (1, 3, 0, 2)):
        a = base.permute(perm)
        for dims in ((3,), (0,), (1, 2), (2, 0), (3, 0, 2)):
            for placements in ([Replicate()], [Shard(1)]):
                x = make_dtensor(a, m, placements)
                for name, fn in ffts.items():
                    out, ref = fn(x, list(dims)), fn(a, list(dims))
                    what = f"{perm} {dims} {placements} {name}"
                    if _dim_order(out) != _dim_order(ref):
                        failures[f"{what}: strides"] = (tuple(out.stride()), tuple(ref.stride()))
                    if (bad := mismatch(out.full_tensor(), ref)) is not None:
                        failures[f"{what}: values"] = bad
    return failures


def _case_conv1d_of_one_channel():
    """conv1d on CPU runs a 3-d input as (N, C, 1, L): with one channel that view is also
    channels-last and the result comes out so (chain fuzzer seed 49003445: a movedim of a
    (4, 6, 1) value); torch's meta kernel said contiguous. Transposed too; a permuted input
    of two channels is made contiguous first (a control)."""
    failures = {}
    one = rand((4, 6, 1), seed=6).movedim(1, 2)  # (4, 1, 6), strides (6, 1, 1)
    two = rand((4, 6, 2), seed=7).movedim(1, 2)  # (4, 2, 6), strides (12, 1, 2)
    cases = {
        "conv1d_one_channel": (one, lambda x: F.conv1d(x, rand((3, 1, 1), seed=8))),
        "conv_transpose1d_one_channel": (one, lambda x: F.conv_transpose1d(x, rand((1, 3, 2), seed=9))),
        "conv1d_two_channels_permuted": (two, lambda x: F.conv1d(x, rand((3, 2, 2), seed=10))),
    }
    for mesh_name in ("1d4", "2d"):
        m = mesh(mesh_name)
        for placements in ([Replicate()] * m.ndim, [Shard(0)] + [Replicate()] * (m.ndim - 1)):
            for name, (a, fn) in cases.items():
                _check(fn(make_dtensor(a, m, placements)), fn(a), f"{mesh_name} {placements} {name}", failures)
    return failures


def test_conv1d_of_one_channel_laid_out_as_on_one_device(pool4):
    for failures in pool4.run(_case_conv1d_of_one_channel):
        assert failures == {}


def test_fft_results_laid_out_as_on_one_device(pool4):
    for failures in pool4.run(_case_fft_results_laid_out_as_mkl_lays_them_out):
        assert failures == {}
