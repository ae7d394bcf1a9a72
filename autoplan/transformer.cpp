#include "autoplan/transformer.h"

#include <c10/util/Exception.h>

namespace vescale::autoplan {

const char* recompute_name(Recompute r) {
  return r == Recompute::none ? "none" : r == Recompute::selective ? "selective" : "full";
}

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::none;
  if (s == "selective") return Recompute::selective;
  if (s == "full") return Recompute::full;
  TORCH_CHECK_VALUE(false, "unknown recompute '", s, "'; use 'none', 'selective' or 'full'");
}

Work& Work::operator+=(const Work& o) {
  gemm_flops += o.gemm_flops;
  fp8_gemm_flops += o.fp8_gemm_flops;
  attn_flops += o.attn_flops;
  hbm_bytes += o.hbm_bytes;
  return *this;
}

namespace {

Work scaled(const Work& w, double gemm, double attn, double hbm) {
  Work out;
  out.gemm_flops = w.gemm_flops * gemm;
  out.fp8_gemm_flops = w.fp8_gemm_flops * gemm;
  out.attn_flops = w.attn_flops * attn;
  out.hbm_bytes = w.hbm_bytes * hbm;
  return out;
}

// Quantising one element of an FP8 GEMM operand with current scaling: read for the scale
// (amax), read again to cast, write the FP8 value as is and transposed.
double fp8_cast_bytes(const Transformer& m) { return 2 * m.dtype_bytes + 2; }

// Backward costs two matmuls per forward matmul (input and weight gradients); a fused
// attention backward runs five block matmuls against the forward's two (it recomputes the
// scores); memory-bound kernels read the saved input and the incoming gradient and write
// one gradient, about twice a forward's traffic.
Work backward_of(const Work& fwd) { return scaled(fwd, 2.0, 2.5, 2.0); }

}  // namespace

LayerWork layer_work(const Transformer& m, const Shard& sh) {
  const double b = static_cast<double>(sh.micro_batch), S = static_cast<double>(m.seq);
  const double Sl = S / static_cast<double>(sh.cp);  // this rank's tokens of each sequence
  const double T = b * Sl, h = static_cast<double>(m.hidden), f = static_cast<double>(m.ffn);
  const double t = static_cast<double>(sh.tp), e = m.dtype_bytes;
  const double hq = static_cast<double>(m.q_dim()), hkv = static_cast<double>(m.kv_dim());
  const double heads = static_cast<double>(m.heads);
  // The parts outside the tensor-parallel matmuls (norms, residual adds, dropout) are
  // split by t only with sequence parallelism.
  const double r = sh.sequence_parallel ? 1.0 / t : 1.0;
  const double x = T * h * e;  // one full activation
  const double P = b * (heads / t) * Sl * S;  // elements of this rank's s x s attention scores

  LayerWork out;
  Work& fwd = out.forward;
  const double mlp_in = m.gated_mlp ? 2 * f : f;  // gate and up projections, or one
  const double linear_flops = 2 * T * h * (hq + 2 * hkv) / t  // QKV
                              + 2 * T * hq * h / t            // output projection
                              + 2 * T * h * (mlp_in + f) / t;  // MLP in and out
  (m.fp8 ? fwd.fp8_gemm_flops : fwd.gemm_flops) = linear_flops;
  const double core_flops = 4 * b * Sl * S * hq / t;  // Q K^T and scores x V (this rank's queries, all keys)
  Work core;  // the attention between the QKV and output projections
  if (m.flash_attention) {
    core.attn_flops = core_flops * (m.causal ? 0.5 : 1.0);
  } else {
    core.gemm_flops = core_flops;
    core.hbm_bytes = 2 * P * e + (m.dropout ? P * (2 * e + 1) : 0);  // fused softmax; dropout + mask
  }
  fwd += core;
  fwd.hbm_bytes += 4 * x * r                                    // two norms: read, write
                   + 2 * (m.dropout ? 3 * e + 1 : 3 * e) * T * h * r  // two (bias-dropout-)residual adds
                   + (m.gated_mlp ? 3 : 2) * T * f * e / t       // (bias-)activation
                   + (m.learned_positions ? 0 : 2 * T * (hq + hkv) * e / t);  // rotary on q, k
  out.backward = backward_of(fwd);
  (m.fp8 ? out.wgrad.fp8_gemm_flops : out.wgrad.gemm_flops) = linear_flops;  // half of backward's
  if (m.fp8) {
    // Operands quantised: forward, the four layers' inputs (with sequence parallelism the
    // QKV and MLP inputs on the local shard, before the gather); backward, the gradients
    // of their outputs. The weights are quantised once a step (not counted).
    const double in = T * (2 * h * r + hq / t + f / t);
    const double grad_out = T * ((hq + 2 * hkv) / t + mlp_in / t + 2 * h * r);
    fwd.hbm_bytes += in * fp8_cast_bytes(m);
    out.backward.hbm_bytes += grad_out * fp8_cast_bytes(m);
  }

  // Saved for backward (Korthikanti et al. 2022, section 4.1, term by term).
  // A linear layer's input is kept in FP8 (1 byte) when it runs in FP8.
  const double lin_e = m.fp8 ? 1.0 : e;
  double saved_core = 0, s2 = 0;
  if (m.flash_attention) {
    saved_core = T * (hq + 2 * hkv) * e / t + T * hq * e / t  // q, k, v and the output (= projection input)
                 + b * (heads / t) * Sl * 4                   // fp32 log-sum-exp per row
                 + (m.fp8 ? T * hq / t : 0);                  // the projection's own FP8 copy of its input
  } else {
    saved_core = T * (hq + hkv) * e / t      // q, k for Q K^T
                 + T * hkv * e / t           // v for scores x V
                 + T * hq * lin_e / t;       // context: the output projection's input
    s2 = P * e + (m.dropout ? P * (1 + e) : 0);  // softmax output; dropout mask and output
  }
  const double saved_outside = 2 * x * r  // norm inputs
                               + x * r * lin_e / e  // QKV input
                               + x * r * lin_e / e  // MLP input
                               + (m.dropout ? 2 * T * h * r : 0)  // the two hidden-dropout masks, 1 byte
                               + T * (mlp_in * e + f * lin_e) / t;  // activation input(s), and output (MLP out's input)
  const double saved_all = saved_outside + saved_core + s2;
  // The weight pass reads the four linear layers' inputs (as saved) and the gradients of
  // their outputs (whole: with sequence parallelism gathered before the matmul).
  out.wgrad_held_bytes = 2 * x * r * lin_e / e + T * (hq + f) * lin_e / t  // inputs
                         + T * (hq + 2 * hkv + mlp_in) * e / t + 2 * x;    // output gradients

  if (sh.tp > 1) {
    if (sh.sequence_parallel) {
      out.tp_forward = {0, 2, 2};   // gather before QKV and MLP, reduce-scatter after projections
      out.tp_backward = {0, 2, 2};  // the transposes
    } else {
      out.tp_forward = {2, 0, 0};   // after the output projection and the MLP
      out.tp_backward = {2, 0, 0};  // before QKV and the MLP (the gradient of their input)
    }
  }
  out.tp_bytes = x;
  // With sequence parallelism Transformer Engine gathers the FP8 copies (inputs forward,
  // output gradients backward); the reduce-scatters and all-reduces stay in dtype_bytes.
  out.tp_gather_bytes = m.fp8 ? x / e : x;

  if (sh.cp > 1) {
    out.cp_forward = out.cp_backward = static_cast<int>(sh.cp - 1);
    out.cp_bytes = T * 2 * hkv * e / t;  // this rank's K and V
  }
  // The ring's receive buffers: the next K/V block, and in backward their gradients.
  const double ring = 4 * out.cp_bytes;

  // While a layer runs its backward it holds gradients about as large as what it saved
  // (one per saved tensor, freed as it goes), on top of whatever it recomputed.
  switch (sh.recompute) {
    case Recompute::none:
      out.saved_bytes = saved_all;
      out.peak_extra_bytes = saved_all + ring;
      break;
    case Recompute::selective:
      // Only the s x s part is recomputed; with fused attention there is none to drop.
      out.saved_bytes = saved_all - s2;
      if (!m.flash_attention) out.recompute = core;
      out.peak_extra_bytes = saved_all + s2 + ring;
      break;
    case Recompute::full:
      out.saved_bytes = x * r;  // the layer input
      out.recompute = fwd;
      out.tp_recompute = out.tp_forward;
      out.cp_recompute = out.cp_forward;
      out.peak_extra_bytes = 2 * saved_all + ring;
      break;
  }
  return out;
}

LayerWork embedding_work(const Transformer& m, const Shard& sh) {
  const double T = static_cast<double>(sh.micro_batch * m.seq / sh.cp), h = static_cast<double>(m.hidden);
  const double t = static_cast<double>(sh.tp), e = m.dtype_bytes;
  const double r = sh.sequence_parallel ? 1.0 / t : 1.0;
  LayerWork out;
  // Each rank looks up its vocabulary slice (zeros elsewhere), the slices are summed over
  // the tensor-parallel group; positions added; dropout.
  out.forward.hbm_bytes = T * h * e + (m.learned_positions ? 2 * T * h * e * r : 0) +
                          (m.dropout ? (2 * e + 1) * T * h * r : 0);
  out.backward = backward_of(out.forward);
  if (sh.tp > 1) {
    if (sh.sequence_parallel) {
      out.tp_forward = {0, 0, 1};
      out.tp_backward = {0, 1, 0};
    } else {
      out.tp_forward = {1, 0, 0};
    }
  }
  out.tp_bytes = out.tp_gather_bytes = T * h * e;
  out.saved_bytes = m.dropout ? T * h * r : 0;
  return out;
}

LayerWork head_work(const Transformer& m, const Shard& sh) {
  const double T = static_cast<double>(sh.micro_batch * m.seq / sh.cp), h = static_cast<double>(m.hidden);
  const double V = static_cast<double>(m.vocab), t = static_cast<double>(sh.tp), e = m.dtype_bytes;
  const double r = sh.sequence_parallel ? 1.0 / t : 1.0;
  LayerWork out;
  out.forward.gemm_flops = 2 * T * h * V / t;
  // Final norm; vocabulary-parallel cross-entropy in fp32: read the logits, write and
  // reread fp32 exponentials.
  out.forward.hbm_bytes = 2 * T * h * e * r + (e + 8) * T * V / t;
  out.backward.gemm_flops = 2 * out.forward.gemm_flops;
  out.wgrad.gemm_flops = out.forward.gemm_flops;
  out.wgrad_held_bytes = T * h * e + T * V * e / t;  // its (gathered) input and the logits' gradient
  out.backward.hbm_bytes = 4 * T * h * e * r + (4 + e) * T * V / t;
  if (sh.tp > 1) {
    if (sh.sequence_parallel) {
      out.tp_forward = {0, 1, 0};   // gather the sequence before the head
      out.tp_backward = {0, 0, 1};
    } else {
      out.tp_backward = {1, 0, 0};  // the gradient of the head's (replicated) input
    }
  }
  out.tp_bytes = out.tp_gather_bytes = T * h * e;
  out.saved_bytes = T * h * e * r  // norm input
                    + T * h * e * r  // head input
                    + 4 * T * V / t; // fp32 softmax for the cross-entropy gradient
  return out;
}

double layer_params(const Transformer& m, int64_t tp) {
  const double h = static_cast<double>(m.hidden), f = static_cast<double>(m.ffn), t = static_cast<double>(tp);
  const double hq = static_cast<double>(m.q_dim()), hkv = static_cast<double>(m.kv_dim());
  const double mlp_in = m.gated_mlp ? 2 * f : f;  // gate and up, or one
  const double split = h * (hq + 2 * hkv) + hq * h + h * mlp_in + f * h +
                       (m.biases ? (hq + 2 * hkv) + mlp_in : 0);  // column-parallel biases split too
  const double replicated = (m.biases ? 2 * h : 0)  // row-parallel biases
                            + (m.biases ? 4 * h : 2 * h);  // two norms (LayerNorm: weight and bias)
  return split / t + replicated;
}

double layer_linear_weights(const Transformer& m, int64_t tp) {
  const double h = static_cast<double>(m.hidden), f = static_cast<double>(m.ffn);
  const double hq = static_cast<double>(m.q_dim()), hkv = static_cast<double>(m.kv_dim());
  return (h * (hq + 2 * hkv) + hq * h + h * (m.gated_mlp ? 2 * f : f) + f * h) / static_cast<double>(tp);
}

double layer_fp8_weight_bytes(const Transformer& m, int64_t tp) {
  return m.fp8 ? 2 * layer_linear_weights(m, tp) : 0;  // as is and transposed, 1 byte each
}

double embedding_params(const Transformer& m, int64_t tp) {
  const double h = static_cast<double>(m.hidden);
  return static_cast<double>(m.vocab) * h / static_cast<double>(tp) +
         (m.learned_positions ? static_cast<double>(m.seq) * h : 0);
}

double head_params(const Transformer& m, int64_t tp) {
  const double h = static_cast<double>(m.hidden);
  return (m.biases ? 2 * h : h) + (m.tied_embeddings ? 0 : static_cast<double>(m.vocab) * h / static_cast<double>(tp));
}

double total_params(const Transformer& m) {
  return static_cast<double>(m.layers) * layer_params(m, 1) + embedding_params(m, 1) + head_params(m, 1);
}

}  // namespace vescale::autoplan
