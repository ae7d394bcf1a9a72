// The auto-planner's Python face (vescale/autoplan/scale.py is the driver): plain dicts in
// and out, so that Python stays a thin layer and the C++ structs stay free of pybind11.
// Called from dispatch/python_bindings.cpp's module definition.

#include "autoplan/hardware.h"
#include "autoplan/schedule_orders.h"
#include "autoplan/search.h"
#include "autoplan/step_model.h"
#include "autoplan/transformer.h"

#include <torch/extension.h>

#include <algorithm>
#include <functional>
#include <set>

namespace py = pybind11;

namespace vescale::autoplan {
namespace {

// A field of struct T that a dict may set: name -> setter and getter.
template <typename T>
struct Field {
  const char* name;
  std::function<void(T&, const py::handle&)> set;
  std::function<py::object(const T&)> get;
};

template <typename T, typename V>
Field<T> field(const char* name, V T::*member) {
  return {name, [member](T& t, const py::handle& v) { t.*member = v.cast<V>(); },
          [member](const T& t) { return py::cast(t.*member); }};
}

template <typename T>
void set_fields(T& obj, const py::dict& d, const std::vector<Field<T>>& fields, const char* what) {
  for (const auto& [k, v] : d) {
    const auto key = py::cast<std::string>(k);
    const auto it = std::find_if(fields.begin(), fields.end(), [&](const Field<T>& f) { return key == f.name; });
    if (it == fields.end()) {
      std::string known;
      for (const auto& f : fields) known += (known.empty() ? "" : ", ") + std::string(f.name);
      TORCH_CHECK_VALUE(false, "unknown ", what, " key '", key, "'; known: ", known);
    }
    it->set(obj, v);
  }
}

template <typename T>
py::dict get_fields(const T& obj, const std::vector<Field<T>>& fields) {
  py::dict out;
  for (const auto& f : fields) out[f.name] = f.get(obj);
  return out;
}

const std::vector<Field<Transformer>>& transformer_fields() {
  static const std::vector<Field<Transformer>> f = {
      field("name", &Transformer::name),         field("layers", &Transformer::layers),
      field("hidden", &Transformer::hidden),     field("heads", &Transformer::heads),
      field("kv_heads", &Transformer::kv_heads), field("ffn", &Transformer::ffn),
      field("vocab", &Transformer::vocab),       field("seq", &Transformer::seq),
      field("global_batch", &Transformer::global_batch), field("dtype_bytes", &Transformer::dtype_bytes),
      field("grad_bytes", &Transformer::grad_bytes), field("optimizer_bytes", &Transformer::optimizer_bytes),
      field("gated_mlp", &Transformer::gated_mlp), field("flash_attention", &Transformer::flash_attention),
      field("causal", &Transformer::causal),     field("dropout", &Transformer::dropout),
      field("biases", &Transformer::biases),     field("learned_positions", &Transformer::learned_positions),
      field("tied_embeddings", &Transformer::tied_embeddings)};
  return f;
}

const std::vector<Field<Hardware>>& hardware_fields() {
  static const std::vector<Field<Hardware>> f = {
      field("name", &Hardware::name),
      field("gpus_per_node", &Hardware::gpus_per_node),
      field("hbm_bytes", &Hardware::hbm_bytes),
      field("reserved_bytes", &Hardware::reserved_bytes),
      field("peak_flops", &Hardware::peak_flops),
      field("gemm_efficiency", &Hardware::gemm_efficiency),
      field("attention_efficiency", &Hardware::attention_efficiency),
      field("hbm_bw", &Hardware::hbm_bw),
      field("hbm_efficiency", &Hardware::hbm_efficiency),
      field("nvlink_bw", &Hardware::nvlink_bw),
      field("nvlink_efficiency", &Hardware::nvlink_efficiency),
      field("nvlink_latency", &Hardware::nvlink_latency),
      field("ib_bw", &Hardware::ib_bw),
      field("ib_efficiency", &Hardware::ib_efficiency),
      field("ib_latency", &Hardware::ib_latency),
      field("overlap_compute_share", &Hardware::overlap_compute_share)};
  return f;
}

Transformer to_transformer(const py::dict& d) {
  Transformer m;
  set_fields(m, d, transformer_fields(), "workload");
  TORCH_CHECK_VALUE(m.layers > 0 && m.hidden > 0 && m.heads > 0 && m.ffn > 0 && m.vocab > 0 && m.seq > 0 &&
                        m.global_batch > 0,
                    "workload needs positive layers, hidden, heads, ffn, vocab, seq and global_batch");
  if (m.kv_heads <= 0) m.kv_heads = m.heads;
  TORCH_CHECK_VALUE(m.hidden % m.heads == 0 && m.heads % m.kv_heads == 0, "workload: heads must divide hidden, "
                    "kv_heads must divide heads");
  return m;
}

// {"name": "h100_sxm", ...overrides}
Hardware to_hardware(const py::dict& d) {
  TORCH_CHECK_VALUE(d.contains("name"), "hardware needs a 'name' (one of a100_80gb, h100_sxm)");
  Hardware hw = hardware(d["name"].cast<std::string>());
  set_fields(hw, d, hardware_fields(), "hardware");
  return hw;
}

ParallelConfig to_config(const py::dict& d) {
  ParallelConfig c;
  static const std::set<std::string> known = {"dp", "tp", "pp", "vp", "micro_batch", "zero", "sequence_parallel",
                                              "recompute", "layers_per_stage"};
  for (const auto& [k, v] : d) {
    const auto key = k.cast<std::string>();
    TORCH_CHECK_VALUE(known.count(key), "unknown parallel config key '", key,
                      "'; known: dp, tp, pp, vp, micro_batch, zero, sequence_parallel, recompute, layers_per_stage");
    if (key == "dp") c.dp = v.cast<int64_t>();
    else if (key == "tp") c.tp = v.cast<int64_t>();
    else if (key == "pp") c.pp = v.cast<int64_t>();
    else if (key == "vp") c.vp = v.cast<int64_t>();
    else if (key == "micro_batch") c.micro_batch = v.cast<int64_t>();
    else if (key == "zero") c.zero = v.cast<int>();
    else if (key == "sequence_parallel") c.sequence_parallel = v.cast<bool>();
    else if (key == "recompute") c.recompute = parse_recompute(v.cast<std::string>());
    else c.layers_per_stage = v.cast<std::vector<int64_t>>();
  }
  return c;
}

py::dict from_config(const ParallelConfig& c) {
  py::dict d;
  d["dp"] = c.dp;
  d["tp"] = c.tp;
  d["pp"] = c.pp;
  d["vp"] = c.vp;
  d["micro_batch"] = c.micro_batch;
  d["zero"] = c.zero;
  d["sequence_parallel"] = c.sequence_parallel;
  d["recompute"] = recompute_name(c.recompute);
  d["layers_per_stage"] = c.layers_per_stage;
  return d;
}

py::dict from_estimate(const StepEstimate& e) {
  py::dict d;
  d["feasible"] = e.feasible;
  d["reason"] = e.reason;
  d["config"] = from_config(e.config);
  d["label"] = e.config.str();
  d["microbatches"] = e.microbatches;
  d["step_s"] = e.step_s;
  d["lower_bound_s"] = e.lower_bound_s;
  d["pipeline_s"] = e.pipeline_s;
  d["bubble"] = e.bubble;
  const auto& b = e.breakdown;
  d["breakdown"] = py::dict(py::arg("compute") = b.compute, py::arg("recompute") = b.recompute,
                            py::arg("tp_comm") = b.tp_comm, py::arg("zero_comm") = b.zero_comm,
                            py::arg("idle") = b.idle, py::arg("dp_exposed") = b.dp_exposed,
                            py::arg("embedding_sync") = b.embedding_sync, py::arg("optimizer") = b.optimizer);
  const auto& m = e.memory;
  d["memory"] = py::dict(py::arg("params") = m.params, py::arg("grads") = m.grads, py::arg("optimizer") = m.optimizer,
                         py::arg("activations") = m.activations, py::arg("other") = m.other,
                         py::arg("total") = m.total());
  d["memory_rank"] = e.memory_rank;
  d["rank_memory"] = e.rank_memory;
  d["stage_forward"] = e.stage_forward;
  d["stage_backward"] = e.stage_backward;
  d["model_flops"] = e.model_flops;
  return d;
}

SearchConstraints to_constraints(const py::dict& d) {
  SearchConstraints c;
  static const std::vector<Field<SearchConstraints>> f = {
      field("world", &SearchConstraints::world),
      field("memory_limit", &SearchConstraints::memory_limit),
      field("tp", &SearchConstraints::tp),
      field("pp", &SearchConstraints::pp),
      field("dp", &SearchConstraints::dp),
      field("vp", &SearchConstraints::vp),
      field("min_vp", &SearchConstraints::min_vp),
      field("micro_batch", &SearchConstraints::micro_batch),
      field("microbatches", &SearchConstraints::microbatches),
      field("zero", &SearchConstraints::zero),
      field("sequence_parallel", &SearchConstraints::sequence_parallel),
      field("recompute", &SearchConstraints::recompute),
      field("max_tp", &SearchConstraints::max_tp),
      field("max_micro_batch", &SearchConstraints::max_micro_batch),
      field("split", &SearchConstraints::split),
      field("top_k", &SearchConstraints::top_k),
      field("keep_rejected", &SearchConstraints::keep_rejected)};
  set_fields(c, d, f, "search constraint");
  TORCH_CHECK_VALUE(c.world >= 1, "search needs a world size >= 1");
  return c;
}

}  // namespace

void bind_autoplan(py::module& m) {
  m.def("autoplan_hardware", [](const std::string& name) { return get_fields(hardware(name), hardware_fields()); },
        "One machine of the planner's hardware table (autoplan/hardware.cpp) as a dict.");
  m.def("autoplan_hardware_names", &hardware_names);
  m.def("autoplan_workload", [](const py::dict& w) {
    const Transformer t = to_transformer(w);
    py::dict d = get_fields(t, transformer_fields());
    d["total_params"] = total_params(t);
    d["layer_params"] = layer_params(t, 1);
    return d;
  }, "The workload dict completed with defaults, and its parameter counts.");
  m.def("autoplan_orders", [](int32_t ranks, int32_t microbatches, int32_t virtual_stages) {
    const Orders o = one_f_one_b(ranks, microbatches, virtual_stages);
    py::list out;
    for (const auto& order : o.orders) {
      py::list r;
      for (const auto& a : order) r.append(py::make_tuple(std::string(1, a.kind), a.stage, a.mb));
      out.append(r);
    }
    return out;
  }, "The C++ 1F1B / interleaved 1F1B orders (autoplan/schedule_orders.h), per rank (kind, stage, mb).");
  m.def("autoplan_estimate",
        [](const py::dict& workload, const py::dict& hw, const py::dict& config, double memory_limit,
           const std::string& split, bool simulate) {
          StepOptions opt;
          opt.memory_limit = memory_limit;
          opt.split = split;
          opt.simulate = simulate;
          const Transformer t = to_transformer(workload);
          const Hardware h = to_hardware(hw);
          const ParallelConfig c = to_config(config);
          StepEstimate e;
          {
            py::gil_scoped_release release;
            e = estimate_step(t, h, c, opt);
          }
          return from_estimate(e);
        },
        py::arg("workload"), py::arg("hardware"), py::arg("config"), py::arg("memory_limit") = 0.0,
        py::arg("split") = "balanced", py::arg("simulate") = true,
        "One step of `workload` under `config` on `hardware` (autoplan/step_model.h).");
  m.def("autoplan_search", [](const py::dict& workload, const py::dict& hw, const py::dict& constraints) {
    const Transformer t = to_transformer(workload);
    const Hardware h = to_hardware(hw);
    const SearchConstraints c = to_constraints(constraints);
    SearchResult r;
    {
      py::gil_scoped_release release;
      r = search(t, h, c);
    }
    py::dict d;
    py::list ranked, rejected;
    for (const auto& x : r.ranked) {
      py::dict e = from_estimate(x.estimate);
      e["verdict"] = x.verdict;
      ranked.append(e);
    }
    for (const auto& x : r.rejected) {
      py::dict e = from_estimate(x.estimate);
      e["verdict"] = x.verdict;
      rejected.append(e);
    }
    d["ranked"] = ranked;
    d["rejected"] = rejected;
    d["enumerated"] = r.enumerated;
    d["invalid"] = r.invalid;
    d["over_memory"] = r.over_memory;
    d["pruned"] = r.pruned;
    d["simulated"] = r.simulated;
    d["seconds"] = r.seconds;
    return d;
  }, "The planner's search (autoplan/search.h): ranked candidates and the rejected, with reasons.");
}

}  // namespace vescale::autoplan
