"""Complex values on DTensors: the rotary embedding of torchtitan's and Meta's Llama
(pairs of the head dim as complex numbers), FFTs, and complex values crossing the mesh.
gloo has no complex type: collectives carry the real view (collectives.cpp). Every case
is compared with one device, forward and gradients, on a 1-d mesh of 4 and on 2x2."""

from __future__ import annotations

import pytest
import torch

import vescale
from vescale import Partial, Replicate, Shard

from dist_utils import make_dtensor, mesh, mismatch, rand


def _freqs_cis(seq: int, dim: int) -> torch.Tensor:
    """torchtitan's precompute_freqs_cis, in float64."""
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _rope(xq: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """torchtitan's apply_rotary_emb for one tensor: [batch, seq, heads, head_dim]."""
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs).flatten(3)


# (query placements, freqs_cis placements) per mesh: heads split (tensor parallel), sequence
# split (sequence parallel, freqs split alike), batch split, the head dim split, unevenly too
ROPE_CASES = {
    "1d4": [([Shard(2)], [Replicate()]), ([Shard(1)], [Shard(0)]), ([Shard(1)], [Replicate()]),
            ([Shard(0)], [Replicate()]), ([Shard(3)], [Replicate()]), ([Partial()], [Replicate()]),
            ([Partial("max")], [Replicate()])],  # reduced before view_as_complex (fuzz seed 44000588)
    "2d": [([Shard(0), Shard(2)], [Replicate(), Replicate()]), ([Shard(2), Shard(1)], [Replicate(), Shard(0)]),
           ([Replicate(), Shard(3)], [Replicate(), Replicate()])],
}


def _case_rope_matches_one_device():
    failures = {}
    x = rand((2, 6, 5, 8), seed=1)  # 5 heads and 6 positions: uneven over 4 ranks
    freqs = _freqs_cis(6, 8)
    weight = rand((2, 6, 5, 8), seed=2)
    ref_x = x.clone().requires_grad_()
    ref = _rope(ref_x, freqs)
    (ref * weight).sum().backward()
    for mesh_name, cases in ROPE_CASES.items():
        m = mesh(mesh_name)
        for xp, fp in cases:
            vescale.reset_fallback_counts()
            dx = make_dtensor(x, m, xp).requires_grad_()
            out = _rope(dx, make_dtensor(freqs, m, fp))
            (out * make_dtensor(weight, m, [Replicate()] * m.ndim)).sum().backward()
            what = f"{mesh_name} {xp} {fp}"
            if (bad := mismatch(out.full_tensor(), ref.detach())) is not None:
                failures[f"{what}: output"] = bad
            if (bad := mismatch(dx.grad.full_tensor(), ref_x.grad)) is not None:
                failures[f"{what}: gradient"] = bad
            # The rotation is per element pair: a split of heads, positions or batch stays
            # split, with no gather of the query through the replicate fallback.
            if not xp[-1].is_partial() and list(out.placements) != list(xp):
                failures[f"{what}: placements"] = out.placements
            if vescale.fallback_counts():
                failures[f"{what}: fallback"] = vescale.fallback_counts()
    return failures


def test_rotary_embedding_as_torchtitan_applies_it(pool4):
    for failures in pool4.run(_case_rope_matches_one_device):
        assert failures == {}


FFTS = {
    "rfft_irfft": lambda x, d: torch.fft.irfft(torch.fft.rfft(x, dim=d) * (1 + torch.arange(x.shape[d] // 2 + 1)
                                                                          .double().view(-1, *[1] * (x.dim() - 1 - d))),
                                               n=x.shape[d], dim=d),
    "fft_abs": lambda x, d: torch.fft.fft(x, dim=d).abs(),
    "fftn_real": lambda x, d: torch.fft.fftn(x).real,
    "hfft": lambda x, d: torch.fft.hfft(x, dim=d),
    "ihfft_angle": lambda x, d: torch.fft.ihfft(x, dim=d).angle(),
}


def _case_ffts_match_one_device():
    failures = {}
    x = rand((8, 6, 5), seed=3)
    for mesh_name in ("1d4", "2d"):
        m = mesh(mesh_name)
        for placements in ([Shard(0)] * m.ndim, [Shard(1)] + [Replicate()] * (m.ndim - 1),
                           [Replicate()] * (m.ndim - 1) + [Shard(2)], [Partial()] * m.ndim):
            for name, fn in FFTS.items():
                for d in (0, 2):  # across a split dim, and along one
                    ref_x = x.clone().requires_grad_()
                    ref = fn(ref_x, d)
                    ref.sum().backward()
                    dx = make_dtensor(x, m, placements).requires_grad_()
                    out = fn(dx, d)
                    out.sum().backward()
                    what = f"{mesh_name} {placements} {name} dim {d}"
                    if (bad := mismatch(out.full_tensor(), ref.detach())) is not None:
                        failures[f"{what}: output"] = bad
                    if (bad := mismatch(dx.grad.full_tensor(), ref_x.grad)) is not None:
                        failures[f"{what}: gradient"] = bad
    return failures


def test_ffts_match_one_device(pool4):
    for failures in pool4.run(_case_ffts_match_one_device):
        assert failures == {}


def _case_complex_values_cross_the_mesh():
    failures = {}
    z = torch.complex(rand((8, 6), seed=4), rand((8, 6), seed=5))
    m = mesh("1d4")
    cases = {
        # a sum over a split dim leaves a Partial complex value: reduced by an all-reduce
        "sum": (lambda t: t.sum(0), [Shard(0)]),
        "matmul": (lambda t: t.T @ t, [Shard(0)]),
        # gathers (the conjugate bit resolved first), all-to-all, reduce-scatter
        "gather_conj": (lambda t: t.conj().redistribute(t.device_mesh, [Replicate()]) if isinstance(t, vescale.DTensor)
                        else t.conj(), [Shard(1)]),
        "reshard": (lambda t: t.redistribute(t.device_mesh, [Shard(1)]) if isinstance(t, vescale.DTensor) else t,
                    [Shard(0)]),
        "reduce_scatter": (lambda t: t.redistribute(t.device_mesh, [Shard(0)]) if isinstance(t, vescale.DTensor)
                           else t, [Partial()]),
        "real_imag_angle": (lambda t: t.real * t.imag + t.angle(), [Shard(1)]),
    }
    for name, (fn, placements) in cases.items():
        out = fn(make_dtensor(z, m, placements))
        if (bad := mismatch(out.full_tensor().resolve_conj(), fn(z).resolve_conj())) is not None:
            failures[name] = bad
    # complex numbers have no order: a max reduction of one is refused, on every rank
    pmax = vescale.DTensor.from_local(z[:2].clone(), m, [Partial("max")], shape=(2, 6))
    with pytest.raises(RuntimeError, match="max or min reduction of a complex tensor"):
        pmax.full_tensor()
    return failures


def test_complex_values_cross_the_mesh(pool4):
    for failures in pool4.run(_case_complex_values_cross_the_mesh):
        assert failures == {}
