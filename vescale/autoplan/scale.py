"""Planning at scale: the search of the C++ planner (``autoplan/``) over simulated worlds
of hundreds or thousands of GPUs, and the published runs it is validated against.

The search, the cost model, the pipeline timeline and the memory model are C++
(``autoplan/search.h``, ``step_model.h``, ``transformer.h``, ``comm_time.h``,
``hardware.cpp``); this module turns a model description and the RFC's constraints into
their inputs and their results into ``vescale.Plan`` s and readable text::

    from vescale.autoplan import Workload, plan_at_scale
    result = plan_at_scale(Workload.llama3_70b(), world=1024, hardware="h100_sxm")
    print(result)                 # predicted step, memory per GPU, runners-up and why they lost
    plan = result.to_plan()       # a vescale.Plan (mesh, pipeline, ZeRO, recompute ...)

A workload is a transformer's shapes (``Workload``), or anything with a Hugging Face
style config (``hidden_size``, ``num_hidden_layers``, ... or GPT-2's ``n_embd``, ...).
Constraints use the plan's dotted keys (``"tensor_parallel.size": 8``,
``"memory_per_device": "80GB"``, ``"pipeline_parallel.split_method": "uniform"``, ...);
anything not constrained is searched.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field

from .. import _C
from ..plan import Plan, PlanError

GiB = 1024 ** 3


@dataclass
class Workload:
    """A decoder-only transformer and its batch, as the planner sees it (the C++ side's
    ``autoplan::Transformer``). ``blocks``: the name of the model's list of layers
    (``"model.layers"``), used to write split points and recompute patterns into plans."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    global_batch: int
    kv_heads: int | None = None
    name: str = ""
    dtype_bytes: float = 2        # bf16 / fp16 parameters and activations
    grad_bytes: float = 4         # fp32 gradients (reduced in fp32)
    optimizer_bytes: float = 12   # Adam: fp32 master, two moments
    gated_mlp: bool = True        # SwiGLU
    flash_attention: bool = True
    causal: bool = True
    dropout: bool = False
    biases: bool = False
    learned_positions: bool = False  # False: rotary
    tied_embeddings: bool = False
    fp8: bool = False  # the layers' linear GEMMs in FP8 (Transformer Engine's recipe; simulated only)
    blocks: str | None = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("blocks")
        d["kv_heads"] = d["kv_heads"] or d["heads"]
        return d

    @property
    def params(self) -> float:
        return _C.autoplan_workload(self.to_dict())["total_params"]

    @classmethod
    def from_config(cls, config, *, global_batch: int, seq: int | None = None, blocks: str | None = "model.layers",
                    flash_attention: bool = True, **overrides) -> "Workload":
        """From a Hugging Face style config (or a model with ``.config``): Llama-like
        (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``) or GPT-2-like
        (``n_embd``, ``n_layer``, ``n_head``, ``n_inner``). ``seq`` defaults to the
        config's maximum positions."""
        config = getattr(config, "config", config)
        get = lambda *names, default=None: next((getattr(config, n) for n in names  # noqa: E731
                                                 if getattr(config, n, None) is not None), default)
        gpt2 = hasattr(config, "n_embd")
        hidden = get("hidden_size", "n_embd")
        layers = get("num_hidden_layers", "n_layer")
        heads = get("num_attention_heads", "n_head")
        if None in (hidden, layers, heads):
            raise ValueError(f"{type(config).__name__} has no hidden_size / num_hidden_layers / num_attention_heads "
                             f"(nor GPT-2's n_embd / n_layer / n_head): describe the model with Workload(...)")
        act = str(get("hidden_act", "activation_function", default="silu" if not gpt2 else "gelu"))
        fields = dict(
            name=str(get("model_type", "name_or_path", default=type(config).__name__)),
            layers=layers, hidden=hidden, heads=heads,
            kv_heads=get("num_key_value_heads", default=heads),
            ffn=get("intermediate_size", "n_inner", default=4 * hidden),
            vocab=get("vocab_size"),
            seq=seq or get("max_position_embeddings", "n_positions"),
            global_batch=global_batch,
            gated_mlp=act in ("silu", "swiglu", "swish"),
            flash_attention=flash_attention,
            dropout=bool(get("attention_dropout", "attn_pdrop", default=0.0) or get("resid_pdrop", default=0.0)),
            biases=gpt2 or bool(get("attention_bias", "mlp_bias", default=False)),
            learned_positions=gpt2,
            tied_embeddings=bool(get("tie_word_embeddings", default=gpt2)),
            blocks=blocks if not gpt2 or blocks != "model.layers" else "transformer.h",
        )
        fields.update(overrides)
        return cls(**fields)

    # Published shapes.
    @classmethod
    def llama3_70b(cls, *, global_batch: int = 512, seq: int = 8192, fp8: bool = False) -> "Workload":
        """Llama-3-70B (Meta's config) with Megatron-Bridge's pretraining recipe batch:
        global batch 512 sequences of 8192 tokens (``llama3_70b.pretrain_config``)."""
        return cls(name="llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                   seq=seq, global_batch=global_batch, fp8=fp8, blocks="model.layers")

    @classmethod
    def llama(cls, name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
              global_batch: int, **kw) -> "Workload":
        """A Llama-family model: SwiGLU, RMSNorm, rotary positions, no biases, untied head."""
        return cls(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                   seq=seq, global_batch=global_batch, blocks="model.layers", **kw)

    @classmethod
    def megatron_gpt(cls, name: str, layers: int, hidden: int, heads: int, global_batch: int) -> "Workload":
        """A GPT of Megatron-LM's 2021-2022 papers: MLP 4h, vocabulary 51,200, sequence 2,048,
        learned positions, tied embeddings, dropout, biases, fp16, no fused attention."""
        return cls(name=name, layers=layers, hidden=hidden, heads=heads, ffn=4 * hidden, vocab=51200, seq=2048,
                   global_batch=global_batch, gated_mlp=False, flash_attention=False, dropout=True, biases=True,
                   learned_positions=True, tied_embeddings=True, blocks="layers")


@dataclass(frozen=True)
class PublishedRun:
    """A measured training step: the workload, the configuration it ran with, seconds."""

    workload: Workload
    gpus: int
    config: dict
    step_s: float
    source: str

    @classmethod
    def from_throughput(cls, workload: Workload, gpus: int, config: dict, tokens_per_s_per_gpu: float,
                        source: str) -> "PublishedRun":
        """A run published as tokens per second per GPU (NeMo's tables): the step is the
        global batch's tokens over the whole machine's throughput."""
        step = workload.global_batch * workload.seq / (gpus * tokens_per_s_per_gpu)
        return cls(workload, gpus, config, step, source)


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
# Table 3 (models and parallel sizes, all on Selene's DGX A100 80GB nodes, sequence 2048)
# and Table 5 (seconds per iteration with full recomputation). Interleaving as Calculon's
# validation inputs give it (validation/seqsel/tab5/*_full.json in calculon-ai/calculon).
SELENE_RUNS = (
    PublishedRun(Workload.megatron_gpt("gpt-22B", 48, 6144, 64, 4), 8,
                 dict(dp=1, tp=8, pp=1, vp=1, micro_batch=4, zero=0, recompute="full"), 1.42,
                 "Korthikanti et al. 2022, Tables 3 and 5"),
    PublishedRun(Workload.megatron_gpt("gpt-175B", 96, 12288, 96, 64), 64,
                 dict(dp=1, tp=8, pp=8, vp=3, micro_batch=1, zero=0, recompute="full"), 18.13,
                 "Korthikanti et al. 2022, Tables 3 and 5"),
    PublishedRun(Workload.megatron_gpt("gpt-530B", 105, 20480, 128, 280), 280,
                 dict(dp=1, tp=8, pp=35, vp=3, micro_batch=1, zero=0, recompute="full"), 49.05,
                 "Korthikanti et al. 2022, Tables 3 and 5"),
    PublishedRun(Workload.megatron_gpt("gpt-1T", 128, 25600, 160, 512), 512,
                 dict(dp=1, tp=8, pp=64, vp=1, micro_batch=1, zero=0, recompute="full"), 94.42,
                 "Korthikanti et al. 2022, Tables 3 and 5"),
)

# NeMo 24.12's FP8 pre-training table ("Performance Benchmarks", NeMo Framework user guide
# 24.12: tokens/s/GPU), measured on DGX H100 (the page names no system; it predates NeMo's
# multi-system tables, and its GPT3-175B row at 512 GPUs, 825 tokens/s/GPU, sits beside
# 25.02's DGX-H100 row, 866, not B200's 1,600). Every row uses Transformer Engine FP8 with
# current scaling, the distributed optimizer (ZeRO-1), sequence parallelism and TP
# communication overlap wherever TP > 1, flash attention, no recomputation, Megatron's
# equal split of layers, and gradients reduced in bf16 (Megatron-Bridge's performance
# configs, the successors of these recipes, set grad_reduce_in_fp32 = False:
# scripts/performance/configs/llama/llama3_llm_pretrain.py); these are the recipes'
# defaults, not stated per row. Shapes: the
# models' published configs (GPT-3 175B as NeMo's GPTConfig175B: vocabulary 51,200,
# learned positions, biases, tied embeddings, no dropout; Nemotron-4 340B: squared-ReLU
# MLP 73,728, 8 KV heads, vocabulary 256,000).
_NEMO = "NeMo 24.12 performance summary (FP8, DGX H100)"


def _nemo_run(workload: Workload, gpus: int, tokens_per_s: float, tp: int, pp: int, cp: int = 1, vp: int = 1,
              micro_batch: int = 1) -> PublishedRun:
    dp = gpus // (tp * pp * cp)
    config = dict(dp=dp, tp=tp, pp=pp, cp=cp, vp=vp, micro_batch=micro_batch, zero=1, sequence_parallel=tp > 1,
                  recompute="none")
    return PublishedRun.from_throughput(dataclasses.replace(workload, fp8=True, grad_bytes=2), gpus, config,
                                        tokens_per_s, _NEMO)


def _gpt3_175b(global_batch: int) -> Workload:
    return Workload(name="gpt3-175B", layers=96, hidden=12288, heads=96, ffn=4 * 12288, vocab=51200, seq=2048,
                    global_batch=global_batch, gated_mlp=False, biases=True, learned_positions=True,
                    tied_embeddings=True, blocks="layers")


NEMO_H100_FP8_RUNS = (
    _nemo_run(Workload.llama("llama2-7B", 32, 4096, 32, 32, 11008, 32000, 4096, 128), 8, 16934, tp=1, pp=1),
    _nemo_run(Workload.llama("llama2-13B", 40, 5120, 40, 40, 13824, 32000, 4096, 128), 16, 8715, tp=1, pp=4, vp=10),
    _nemo_run(Workload.llama("llama2-70B", 80, 8192, 64, 8, 28672, 32000, 4096, 128), 64, 1728, tp=4, pp=4, vp=20),
    _nemo_run(Workload.llama("llama3-8B", 32, 4096, 32, 8, 14336, 128256, 8192, 128), 8, 12273, tp=1, pp=1, cp=2),
    _nemo_run(Workload.llama3_70b(global_batch=128), 64, 1524, tp=4, pp=4, cp=2, vp=5),
    _nemo_run(_gpt3_175b(256), 128, 716, tp=4, pp=8, vp=6),
    _nemo_run(_gpt3_175b(2048), 512, 825, tp=4, pp=8, vp=6, micro_batch=2),
    _nemo_run(Workload(name="nemotron4-340B", layers=96, hidden=18432, heads=96, kv_heads=8, ffn=73728,
                       vocab=256000, seq=4096, global_batch=32, gated_mlp=False), 128, 326, tp=8, pp=8, vp=12),
)

# Known-good Llama-3-70B layouts on H100: Megatron-Bridge's recipes
# (recipes/llama/llama3_perf.py: bf16 TP4 PP4 VP5 with context parallelism 2; FP8 TP4 PP8
# VP5) and issue 12's "TP8 PP8 with virtual stages". vp None: any number of virtual
# stages > 1.
LLAMA3_70B_RECIPES = (
    ("Megatron-Bridge bf16 TP4 PP4 VP5 CP2", dict(tp=4, pp=4, vp=5, cp=2)),
    ("Megatron-Bridge fp8 TP4 PP8 VP5", dict(tp=4, pp=8, vp=5, cp=1)),
    ("TP8 PP8 interleaved", dict(tp=8, pp=8, vp=None, cp=1)),
)


def matches_recipe(config: dict, *, exact_vp: bool = True, exact_cp: bool = True) -> str | None:
    """The name of the known-good Llama-3-70B recipe ``config`` follows, or None. With
    ``exact_vp=False`` any interleaved schedule (vp > 1) on the recipe's TP and PP counts;
    with ``exact_cp=False`` any context parallelism (for searches that leave CP out)."""
    for name, want in LLAMA3_70B_RECIPES:
        if config["tp"] != want["tp"] or config["pp"] != want["pp"] or config["vp"] < 2:
            continue
        if exact_cp and config.get("cp", 1) != want["cp"]:
            continue
        if want["vp"] is None or not exact_vp or config["vp"] == want["vp"]:
            return name
    return None


def parse_bytes(value) -> float:
    """``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"512MB"``, or a number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"memory_per_device {value!r}: write bytes, or e.g. '80GB' / '80GiB'")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}[unit]
    return float(m.group(1)) * scale


# constraint key -> C++ search field; values checked below.
_SIZES = {"tensor_parallel.size": "tp", "mesh.TP": "tp", "pipeline_parallel.size": "pp", "mesh.PP": "pp",
          "data_parallel.size": "dp", "mesh.DP": "dp", "pipeline_parallel.virtual_stages": "vp",
          "context_parallel.size": "cp", "context_parallel.max_size": "max_cp",
          "pipeline_parallel.microbatches": "microbatches", "micro_batch_size": "micro_batch"}
_KEYS = set(_SIZES) | {"world_size", "memory_per_device", "pipeline_parallel.schedule",
                       "pipeline_parallel.split_method", "data_parallel.zero_stage",
                       "tensor_parallel.sequence_parallel", "tensor_parallel.sharding_policy", "recompute",
                       "data.global_batch_size"}
_SPLITS = {"uniform": "uniform", "flops": "balanced", "time": "balanced", "parameters": "balanced"}


def _search_constraints(constraints: dict, world: int | None, hardware: dict) -> tuple[dict, int | None]:
    """The RFC's constraints as the C++ search's fields; also a global batch override."""
    out: dict = {}
    batch = None
    for key, value in constraints.items():
        if key not in _KEYS:
            close = difflib.get_close_matches(key, sorted(_KEYS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PlanError(f"unknown planner constraint {key!r}; {hint}known: {sorted(_KEYS)}")
        if key in _SIZES:
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"planner constraint {key!r} is {value!r}; expected an integer >= 1")
            out[_SIZES[key]] = value
        elif key == "world_size":
            world = value
        elif key == "memory_per_device":
            # The device's memory; the hardware's reserve (context, NCCL, allocator) comes off.
            out["memory_limit"] = parse_bytes(value) - hardware["reserved_bytes"]
        elif key == "pipeline_parallel.schedule":
            if value == "1f1b":
                out["vp"], out["zero_bubble"] = 1, 0
            elif value == "interleaved_1f1b":
                out["min_vp"], out["zero_bubble"] = 2, 0
            elif value == "zb_h1":
                out["vp"], out["zero_bubble"] = 1, 1
            else:
                raise PlanError(f"planner constraint pipeline_parallel.schedule is {value!r}; the planner at scale "
                                f"models '1f1b', 'interleaved_1f1b' and 'zb_h1'")
        elif key == "pipeline_parallel.split_method":
            if value not in _SPLITS:
                raise PlanError(f"planner constraint pipeline_parallel.split_method is {value!r}; expected one of "
                                f"{list(_SPLITS)}")
            out["split"] = _SPLITS[value]
        elif key == "data_parallel.zero_stage":
            if value not in (0, 1, 2, 3):
                raise PlanError(f"planner constraint data_parallel.zero_stage is {value!r}; expected 0-3")
            out["zero"] = value
        elif key == "tensor_parallel.sequence_parallel":
            out["sequence_parallel"] = int(bool(value))
        elif key == "tensor_parallel.sharding_policy":
            if value != "megatron":
                raise PlanError(f"planner constraint tensor_parallel.sharding_policy is {value!r}; the planner at "
                                f"scale costs Megatron's column/row pairs ('megatron')")
        elif key == "recompute":
            if value not in ("none", "selective", "full"):
                raise PlanError(f"planner constraint recompute is {value!r}; expected 'none', 'selective' or 'full'")
            out["recompute"] = ("none", "selective", "full").index(value)
        elif key == "data.global_batch_size":
            batch = value
    if world is None:
        raise PlanError("the planner needs a world size: world=... or constraints['world_size']")
    out["world"] = world
    return out, batch


def _hardware(hardware) -> dict:
    if isinstance(hardware, str):
        return {"name": hardware}
    return dict(hardware)


class Candidate:
    """One configuration the planner priced: ``config`` (dp, tp, pp, cp, vp, micro_batch, zero,
    sequence_parallel, recompute, layers_per_stage), ``step_s``, ``memory`` (bytes by kind,
    of the GPU that holds the most), ``verdict`` (why it lost, or why it was refused)."""

    def __init__(self, d: dict, workload: Workload, world: int):
        self._d, self.workload, self.world = d, workload, world

    config = property(lambda self: self._d["config"])
    step_s = property(lambda self: self._d["step_s"])
    memory = property(lambda self: self._d["memory"])
    verdict = property(lambda self: self._d.get("verdict", ""))
    label = property(lambda self: self._d["label"])
    feasible = property(lambda self: self._d["feasible"])
    bubble = property(lambda self: self._d["bubble"])
    breakdown = property(lambda self: self._d["breakdown"])
    microbatches = property(lambda self: self._d["microbatches"])
    rank_memory = property(lambda self: self._d["rank_memory"])  # bytes per GPU, per pipeline rank

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation the prediction implies (per GPU, of the hardware's peak)."""
        return self._d["model_flops"] / (self.world * self._d["peak_flops"] * self.step_s) if self.step_s else 0.0

    def as_dict(self) -> dict:
        return dict(self._d)

    def to_plan(self) -> Plan:
        """The configuration as a ``vescale.Plan``: mesh (PP, DP, TP, outermost first),
        schedule, micro-batches, virtual stages, split points (when the workload names its
        ``blocks``), ZeRO stage, sequence parallelism, recomputation, global batch. The
        tensor-parallel sharding plan is left to the caller (e.g. ``Plan.from_hf``).
        Context parallelism and FP8 have no plan: vescale cannot run them yet (a PlanError
        says so)."""
        c, w = self.config, self.workload
        if w.fp8:
            raise PlanError(f"{self.label} trains {w.name or 'the model'} in FP8, which the planner simulates but "
                            f"vescale cannot run yet; plan the workload with fp8=False for a plan vescale can execute")
        if c.get("cp", 1) > 1:
            raise PlanError(f"{self.label} uses context parallelism (CP {c['cp']}), which the planner simulates but "
                            f"vescale cannot run yet; plan with constraints={{'context_parallel.size': 1}} (the "
                            f"default) for a plan vescale can execute")
        if c.get("zero_bubble") and c["recompute"] == "full":
            raise PlanError(f"{self.label} recomputes under ZB-H1, which vescale refuses (the split backward would "
                            f"recompute every layer once per weight pass); plan with constraints="
                            f"{{'pipeline_parallel.schedule': '1f1b'}} or {{'recompute': 'none'}}")
        plan = Plan({"mesh": {"PP": c["pp"], "DP": c["dp"], "TP": c["tp"]}})
        settings = {
            "pipeline_parallel.schedule": ("zb_h1" if c.get("zero_bubble") else
                                           "interleaved_1f1b" if c["vp"] > 1 else "1f1b"),
            "pipeline_parallel.microbatches": self.microbatches,
            "pipeline_parallel.virtual_stages": c["vp"],
            "data_parallel.zero_stage": c["zero"],
            "tensor_parallel.sequence_parallel": c["sequence_parallel"],
            "data.global_batch_size": w.global_batch,
        }
        if w.dtype_bytes == 2:
            settings["mixed_precision.param_dtype"] = "bfloat16"
        if w.blocks:
            settings["pipeline_parallel.blocks"] = w.blocks
            starts = [sum(c["layers_per_stage"][:s]) for s in range(1, len(c["layers_per_stage"]))]
            if starts:
                settings["pipeline_parallel.split_points"] = [f"{w.blocks}.{i}" for i in starts]
            blocks = re.escape(w.blocks)
            if c["recompute"] == "full":
                settings["recompute.modules"] = [rf"{blocks}\.\d+"]
            elif c["recompute"] == "selective" and not w.flash_attention:
                settings["recompute.modules"] = [rf"{blocks}\.\d+\.(self_attn|attn)"]
        plan.update(settings)
        return plan

    def describe(self) -> str:
        m = self.memory
        return (f"{self.label}: step {self.step_s:.3f} s (MFU {100 * self.mfu:.1f}%), {m['total'] / GiB:.1f} GiB per "
                f"GPU (parameters {m['params'] / GiB:.1f}, gradients {m['grads'] / GiB:.1f}, optimizer "
                f"{m['optimizer'] / GiB:.1f}, activations {m['activations'] / GiB:.1f}, other "
                f"{m['other'] / GiB:.1f}); {self.microbatches} micro-batches, bubble {100 * self.bubble:.1f}%, "
                f"layers per stage {self.config['layers_per_stage']}")

    def __repr__(self) -> str:
        return f"Candidate({self.label}, step {self.step_s:.3f} s, {self.memory['total'] / GiB:.1f} GiB)"


@dataclass
class ScalePlan:
    """The planner's answer: ``ranked`` (best first), ``rejected`` (closest first, with the
    reason), and how many configurations were looked at."""

    workload: Workload
    world: int
    hardware: dict
    ranked: list
    rejected: list
    stats: dict = field(default_factory=dict)

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            raise PlanError(f"no configuration of {self.workload.name or 'the model'} fits {self.world} x "
                            f"{self.hardware['name']}: " + (self.rejected[0].verdict if self.rejected else "none"))
        return self.ranked[0]

    def to_plan(self) -> Plan:
        return self.best.to_plan()

    def __str__(self) -> str:
        s = self.stats
        lines = [f"planned {self.workload.name or 'model'} ({self.workload.params / 1e9:.1f}B parameters, global batch "
                 f"{self.workload.global_batch} x {self.workload.seq} tokens) for {self.world} x "
                 f"{self.hardware['name']} in {s['seconds']:.2f} s: {s['enumerated']} configurations, "
                 f"{s['invalid']} do not divide, {s['over_memory']} over memory, {s['pruned']} pruned by lower "
                 f"bound, {s['simulated']} simulated"]
        if self.ranked:
            lines.append("best: " + self.best.describe())
            if len(self.ranked) > 1:
                lines.append("runners-up:")
                for i, c in enumerate(self.ranked[1:], 2):
                    lines.append(f"  #{i} {c.label:50s} {c.step_s:8.3f} s {c.memory['total'] / GiB:6.1f} GiB  "
                                 f"{c.verdict}")
        if self.rejected:
            lines.append("lost without a place (closest first):")
            for c in self.rejected[:8]:
                lines.append(f"  {c.label:50s} {c.verdict}")
        return "\n".join(lines)


def plan_at_scale(model, world: int | None = None, *, hardware="h100_sxm", constraints: dict | None = None,
                  global_batch: int | None = None, seq: int | None = None, top_k: int = 10,
                  keep_rejected: int = 20) -> ScalePlan:
    """Search every (DP x TP x PP) factorisation of ``world``, the schedule (1F1B, interleaved
    1F1B with its virtual stages, ZB-H1), micro-batch size, ZeRO stage, sequence
    parallelism and recomputation for ``model`` (a
    ``Workload`` or a Hugging Face style config / model, then ``global_batch`` is needed)
    on simulated ``hardware`` (``"h100_sxm"``, ``"a100_80gb"``, or a dict of a name and
    overrides of its table entry). ``constraints`` fix what they name. Context parallelism
    (ring attention over CP ranks, Megatron-Core's) is searched only when asked
    (``"context_parallel.max_size": 8``, or fixed with ``"context_parallel.size"``): vescale
    cannot run it yet, so such plans are simulations of a Megatron-class stack."""
    hw = _hardware(hardware)
    table = {**_C.autoplan_hardware(hw["name"]), **hw}
    search, batch = _search_constraints(constraints or {}, world, table)
    workload = _workload(model, global_batch=batch or global_batch, seq=seq)
    search.update(top_k=top_k, keep_rejected=keep_rejected)
    r = _C.autoplan_search(workload.to_dict(), hw, search)
    for d in r["ranked"] + r["rejected"]:
        d["peak_flops"] = table["peak_flops"]
    stats = {k: r[k] for k in ("enumerated", "invalid", "over_memory", "pruned", "simulated", "seconds")}
    return ScalePlan(workload, search["world"], table, [Candidate(d, workload, search["world"]) for d in r["ranked"]],
                     [Candidate(d, workload, search["world"]) for d in r["rejected"]], stats)


def simulate_step(model, config: dict, *, hardware="h100_sxm", memory_per_device=None, split: str = "balanced",
                  global_batch: int | None = None, seq: int | None = None) -> Candidate:
    """One configuration of ``model`` (``config``: dp, tp, pp, vp, micro_batch, zero,
    sequence_parallel, recompute, optionally layers_per_stage), simulated: step time,
    memory per GPU, breakdown. Infeasible ones come back with ``feasible`` False and the
    reason in ``verdict``."""
    hw = _hardware(hardware)
    table = {**_C.autoplan_hardware(hw["name"]), **hw}
    workload = _workload(model, global_batch=global_batch, seq=seq)
    limit = parse_bytes(memory_per_device) - table["reserved_bytes"] if memory_per_device is not None else 0.0
    d = _C.autoplan_estimate(workload.to_dict(), hw, dict(config), memory_limit=limit, split=split)
    d["verdict"] = d["reason"]
    d["peak_flops"] = table["peak_flops"]
    world = d["config"]["dp"] * d["config"]["tp"] * d["config"]["cp"] * d["config"]["pp"]
    return Candidate(d, workload, world)


def validate_runs(runs, hardware) -> list[dict]:
    """Published runs against the simulator on ``hardware`` (a name, or a dict of a name and
    overrides): per run the prediction, the measurement, the relative error and the
    predicted memory of the fullest GPU. Memory is not a limit here (the runs did fit);
    ``fits`` says whether the model agrees that they do."""
    hw = _hardware(hardware)
    table = {**_C.autoplan_hardware(hw["name"]), **hw}
    out = []
    for run in runs:
        c = simulate_step(run.workload, run.config, hardware=hw, split="uniform", memory_per_device=1 << 50)
        if not c.feasible:
            raise RuntimeError(f"{run.workload.name}: {c.verdict}")
        out.append(dict(name=run.workload.name, gpus=run.gpus, config=c.config, published_s=run.step_s,
                        predicted_s=c.step_s, error=c.step_s / run.step_s - 1, memory=c.memory["total"],
                        fits=c.memory["total"] <= table["hbm_bytes"] - table["reserved_bytes"],
                        mfu=c.mfu, bubble=c.bubble, breakdown=c.breakdown))
    return out


def validate_selene(gemm_efficiency: float | None = None) -> list[dict]:
    """The published Selene runs (``SELENE_RUNS``) against the simulator on ``a100_80gb``.
    ``gemm_efficiency`` overrides the hardware table's (for fitting it)."""
    hw = {"name": "a100_80gb"}
    if gemm_efficiency is not None:
        hw["gemm_efficiency"] = gemm_efficiency
    return validate_runs(SELENE_RUNS, hw)


def validate_nemo_fp8(fp8_gemm_efficiency: float | None = None, *, tp_overlap: float = 1.0) -> list[dict]:
    """NeMo's published FP8 runs (``NEMO_H100_FP8_RUNS``) against the simulator on
    ``h100_sxm`` with TP communication overlapped (as those recipes run).
    ``fp8_gemm_efficiency`` overrides the hardware table's (for fitting it)."""
    hw = {"name": "h100_sxm", "tp_overlap": tp_overlap}
    if fp8_gemm_efficiency is not None:
        hw["fp8_gemm_efficiency"] = fp8_gemm_efficiency
    return validate_runs(NEMO_H100_FP8_RUNS, hw)


def fit_gemm_efficiency(*, low: float = 0.5, high: float = 0.9, step: float = 0.002) -> dict:
    """Fits the A100's GEMM efficiency (the one fitted number of the hardware table) to
    the Selene runs by grid search on the mean absolute relative error: over all four
    (``"all"``: efficiency, mean error), and leaving each run out in turn (``"held_out"``:
    per run, the efficiency fitted on the other three and that run's error with it)."""
    return _fit(SELENE_RUNS, validate_selene, low, high, step)


def fit_fp8_gemm_efficiency(*, low: float = 0.3, high: float = 0.9, step: float = 0.002) -> dict:
    """Fits the H100's FP8 GEMM efficiency to NeMo's published FP8 runs, as
    ``fit_gemm_efficiency`` fits the A100's to Selene's (the same keys)."""
    return _fit(NEMO_H100_FP8_RUNS, validate_nemo_fp8, low, high, step)


def _fit(runs, validate, low: float, high: float, step: float) -> dict:
    grid = [low + step * i for i in range(int(round((high - low) / step)) + 1)]
    errors = [[r["error"] for r in validate(e)] for e in grid]
    n = len(runs)

    def fit(idx):
        i = min(range(len(grid)), key=lambda k: sum(abs(errors[k][j]) for j in idx))
        return i, sum(abs(errors[i][j]) for j in idx) / len(idx)

    i_all, err_all = fit(range(n))
    held_out = []
    for j in range(n):
        i, _ = fit([k for k in range(n) if k != j])
        held_out.append(dict(name=runs[j].workload.name, efficiency=grid[i], error=errors[i][j]))
    return {"all": dict(efficiency=grid[i_all], mean_abs_error=err_all), "held_out": held_out,
            "held_out_mean_abs_error": sum(abs(h["error"]) for h in held_out) / n}


def _workload(model, *, global_batch: int | None, seq: int | None) -> Workload:
    if isinstance(model, Workload):
        if global_batch is not None or seq is not None:
            model = dataclasses.replace(model, global_batch=global_batch or model.global_batch,
                                        seq=seq or model.seq)
        return model
    if isinstance(model, dict):
        return _workload(Workload(**model), global_batch=global_batch, seq=seq)
    if global_batch is None:
        raise PlanError("planning from a model config needs global_batch (sequences per step)")
    return Workload.from_config(model, global_batch=global_batch, seq=seq)
