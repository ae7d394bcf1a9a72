#pragma once
// A decoder-only transformer as the planner sees it: the shapes, and what one layer costs
// one tensor-parallel rank for one micro-batch (FLOPs, memory traffic, collectives, bytes
// saved for backward), derived from the shapes.
//
// Activation bytes follow Korthikanti et al. 2022, "Reducing Activation Recomputation in
// Large Transformer Models", section 4, generalised term by term to grouped-query
// attention, gated MLPs (SwiGLU), no dropout and fused (flash) attention: for GPT with
// dropout the per-layer bytes are s*b*h*(34 + 5*a*s/h) on one rank, s*b*h*(10 + 24/t +
// 5*a*s/(h*t)) with tensor parallelism, s*b*h/t*(34 + 5*a*s/h) with sequence parallelism,
// 34*s*b*h/t with selective recomputation (the s x s attention tensors recomputed) and
// 2*s*b*h (/t with sequence parallelism) with full recomputation (only the layer input).
//
// Context parallelism (CP) splits every sequence over cp ranks, as Megatron-Core does with
// Transformer Engine's ring attention: the sequence is cut into 2*cp chunks and rank i
// holds chunks i and 2*cp-1-i, so that under a causal mask every rank does 1/cp of the
// attention; everything outside attention runs on s/cp tokens. Attention runs in cp
// block steps; before each of the cp-1 later ones a rank passes the K/V block it holds to
// its ring neighbour, while computing on the current block (in backward, K/V and their
// gradients: twice the bytes).
//
// FP8 (Transformer::fp8) is Transformer Engine's per-tensor recipe as Megatron runs it: the
// four linear layers of every transformer layer run their forward, input-gradient and
// weight-gradient GEMMs in FP8 (E4M3 values, E5M2 gradients); attention, the embedding,
// the head and everything memory-bound stay in dtype_bytes. Every FP8 GEMM operand is
// quantised first (with current scaling: read once for the scale, once to cast, written
// twice in FP8, as is and transposed, since Hopper's FP8 GEMM takes only one layout); the
// linear layers keep their FP8 inputs for backward (1 byte an element instead of 2) and
// cache FP8 copies of their weights (both layouts) across a step's micro-batches; with
// sequence parallelism the all-gathers move the FP8 copies.

#include <cstdint>
#include <string>

namespace vescale::autoplan {

enum class Recompute : int { none = 0, selective = 1, full = 2 };
const char* recompute_name(Recompute r);
Recompute parse_recompute(const std::string& s);

struct Transformer {
  std::string name;
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0;
  int64_t seq = 0;           // tokens per sequence
  int64_t global_batch = 0;  // sequences per step
  double dtype_bytes = 2;    // parameters and activations (bf16 / fp16)
  double grad_bytes = 4;     // gradients kept and reduced in fp32 (Megatron's main_grad)
  double optimizer_bytes = 12;  // Adam: fp32 master weights, first and second moments
  bool gated_mlp = false;       // SwiGLU: gate and up projections, then down
  bool flash_attention = false; // fused attention: no s x s tensor in memory or HBM traffic
  bool causal = true;           // a fused kernel skips the masked half of the s x s blocks
  bool dropout = true;          // hidden and attention dropout (1-byte masks saved)
  bool biases = true;           // linear layers and norms with biases (GPT), none (Llama)
  bool learned_positions = true;  // GPT's position embedding table; false: rotary (RoPE)
  bool tied_embeddings = true;    // the head reuses the input embedding
  bool fp8 = false;               // the layers' linear GEMMs in FP8 (Transformer Engine), see above

  int64_t head_dim() const { return hidden / heads; }
  int64_t q_dim() const { return heads * head_dim(); }
  int64_t kv_dim() const { return kv_heads * head_dim(); }
};

// The things one piece of the model does, per micro-batch, on one tensor-parallel rank.
struct Work {
  double gemm_flops = 0;  // dense matmuls (the linear layers, and s x s matmuls without fused attention)
  double fp8_gemm_flops = 0;  // the linear layers' matmuls when they run in FP8
  double attn_flops = 0;  // inside a fused attention kernel
  double hbm_bytes = 0;   // traffic of memory-bound kernels (norms, activations, softmax, dropout, adds)
  Work& operator+=(const Work& o);
};

// Tensor-parallel collectives, each over the full (b, s, h) activation of tp_bytes.
struct TpCollectives {
  int all_reduce = 0, all_gather = 0, reduce_scatter = 0;
};

struct LayerWork {
  Work forward, backward;
  Work recompute;            // forward work redone inside the backward
  Work wgrad;                // the weight-gradient matmuls inside `backward` (a zero-bubble W pass)
  double wgrad_held_bytes = 0;  // kept from a zero-bubble input pass to its weight pass: the
                                // linear layers' inputs and the gradients of their outputs
  TpCollectives tp_forward, tp_backward, tp_recompute;
  double tp_bytes = 0;       // one collective's buffer: b * s * h * dtype_bytes
  double tp_gather_bytes = 0;  // one all-gather's buffer: tp_bytes, or its FP8 copy (1 byte an element)
  double saved_bytes = 0;    // kept from forward to backward for this micro-batch
  double peak_extra_bytes = 0;  // transient during its own backward: gradients, recomputed activations
  // Context-parallel ring attention: steps of a K/V block of cp_bytes passed to the ring
  // neighbour (2 * cp_bytes per backward step: K/V and their gradients), each beside one
  // block of attention (attn_flops / cp of the pass).
  int cp_forward = 0, cp_backward = 0, cp_recompute = 0;
  double cp_bytes = 0;
};

// Shapes a layer is run at.
struct Shard {
  int64_t micro_batch = 1;
  int64_t tp = 1;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::none;
  int64_t cp = 1;  // context parallelism: each rank holds seq / cp tokens of every sequence
};

LayerWork layer_work(const Transformer& m, const Shard& s);
// The first stage's extra: token (and position) embedding lookup.
LayerWork embedding_work(const Transformer& m, const Shard& s);
// The last stage's extra: final norm, vocabulary-parallel head and cross-entropy.
LayerWork head_work(const Transformer& m, const Shard& s);

// Parameters of one tensor-parallel rank (tp = 1: the whole piece).
double layer_params(const Transformer& m, int64_t tp);
// Of these, the linear layers' weights (those FP8 keeps quantised copies of).
double layer_linear_weights(const Transformer& m, int64_t tp);
// Bytes of the FP8 weight copies one layer caches (0 without FP8).
double layer_fp8_weight_bytes(const Transformer& m, int64_t tp);
double embedding_params(const Transformer& m, int64_t tp);  // token (and position) tables
double head_params(const Transformer& m, int64_t tp);       // final norm, and the head when untied
double total_params(const Transformer& m);

}  // namespace vescale::autoplan
