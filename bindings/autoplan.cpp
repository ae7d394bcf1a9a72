// The auto-planner's Python face (vescale/autoplan/scale.py is the driver): plain dicts in
// and out, so that Python stays a thin layer and the C++ structs stay free of pybind11.
// Called from bindings/engine.cpp's module definition.

#include "autoplan/eager.h"
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
      field("tied_embeddings", &Transformer::tied_embeddings), field("fp8", &Transformer::fp8)};
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
      field("fp8_peak_flops", &Hardware::fp8_peak_flops),
      field("fp8_gemm_efficiency", &Hardware::fp8_gemm_efficiency),
      field("attention_efficiency", &Hardware::attention_efficiency),
      field("hbm_bw", &Hardware::hbm_bw),
      field("hbm_efficiency", &Hardware::hbm_efficiency),
      field("nvlink_bw", &Hardware::nvlink_bw),
      field("nvlink_efficiency", &Hardware::nvlink_efficiency),
      field("nvlink_latency", &Hardware::nvlink_latency),
      field("ib_bw", &Hardware::ib_bw),
      field("ib_efficiency", &Hardware::ib_efficiency),
      field("ib_latency", &Hardware::ib_latency),
      field("overlap_compute_share", &Hardware::overlap_compute_share),
      field("tp_overlap", &Hardware::tp_overlap)};
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
  static const std::set<std::string> known = {"dp", "tp", "pp", "cp", "vp", "micro_batch", "zero", "sequence_parallel",
                                              "recompute", "layers_per_stage", "zero_bubble"};
  for (const auto& [k, v] : d) {
    const auto key = k.cast<std::string>();
    TORCH_CHECK_VALUE(known.count(key), "unknown parallel config key '", key,
                      "'; known: dp, tp, pp, cp, vp, micro_batch, zero, sequence_parallel, recompute, layers_per_stage, "
                      "zero_bubble");
    if (key == "dp") c.dp = v.cast<int64_t>();
    else if (key == "tp") c.tp = v.cast<int64_t>();
    else if (key == "pp") c.pp = v.cast<int64_t>();
    else if (key == "cp") c.cp = v.cast<int64_t>();
    else if (key == "vp") c.vp = v.cast<int64_t>();
    else if (key == "micro_batch") c.micro_batch = v.cast<int64_t>();
    else if (key == "zero") c.zero = v.cast<int>();
    else if (key == "sequence_parallel") c.sequence_parallel = v.cast<bool>();
    else if (key == "recompute") c.recompute = parse_recompute(v.cast<std::string>());
    else if (key == "zero_bubble") c.zero_bubble = v.cast<bool>();
    else c.layers_per_stage = v.cast<std::vector<int64_t>>();
  }
  return c;
}

py::dict from_config(const ParallelConfig& c) {
  py::dict d;
  d["dp"] = c.dp;
  d["tp"] = c.tp;
  d["pp"] = c.pp;
  d["cp"] = c.cp;
  d["vp"] = c.vp;
  d["micro_batch"] = c.micro_batch;
  d["zero"] = c.zero;
  d["sequence_parallel"] = c.sequence_parallel;
  d["recompute"] = recompute_name(c.recompute);
  d["zero_bubble"] = c.zero_bubble;
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
                            py::arg("tp_comm") = b.tp_comm, py::arg("cp_comm") = b.cp_comm,
                            py::arg("zero_comm") = b.zero_comm,
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
      field("zero_bubble", &SearchConstraints::zero_bubble),
      field("max_tp", &SearchConstraints::max_tp),
      field("cp", &SearchConstraints::cp),
      field("max_cp", &SearchConstraints::max_cp),
      field("max_micro_batch", &SearchConstraints::max_micro_batch),
      field("split", &SearchConstraints::split),
      field("top_k", &SearchConstraints::top_k),
      field("keep_rejected", &SearchConstraints::keep_rejected)};
  set_fields(c, d, f, "search constraint");
  TORCH_CHECK_VALUE(c.world >= 1, "search needs a world size >= 1");
  return c;
}


// ---- the eager planner (autoplan/eager.h) ----

template <typename T>
T get_or(const py::dict& d, const char* key, T fallback) {
  return d.contains(key) && !d[key].is_none() ? d[key].cast<T>() : fallback;
}

std::vector<eager::Comm> to_comms(const py::handle& list) {
  std::vector<eager::Comm> out;
  for (const auto& c : list) {
    const auto t = c.cast<py::tuple>();
    out.push_back({t[0].cast<std::string>(), t[1].cast<int64_t>(), t[2].cast<double>(), t[3].cast<double>()});
  }
  return out;
}

eager::Problem to_problem(const py::dict& d) {
  eager::Problem p;
  for (const auto& u : d["units"]) {
    const auto ud = u.cast<py::dict>();
    eager::Unit x;
    x.name = ud["name"].cast<std::string>();
    x.kind = ud["kind"].cast<int>();
    x.flops = get_or<double>(ud, "flops", 0.0);
    x.params = get_or<double>(ud, "params", 0.0);
    x.cut_before = get_or<bool>(ud, "cut_before", true);
    p.units.push_back(x);
  }
  for (const auto& l : d["layouts"]) {
    const auto ld = l.cast<py::dict>();
    eager::Layout x;
    x.tp = ld["tp"].cast<int64_t>();
    x.sp = ld["sp"].cast<bool>();
    if (ld.contains("working")) {
      x.has_working = true;
      x.working_a = ld["working"].cast<py::tuple>()[0].cast<double>();
      x.working_b = ld["working"].cast<py::tuple>()[1].cast<double>();
    }
    for (const auto& u : ld["units"]) {
      const auto ud = u.cast<py::dict>();
      eager::UnitCost c;
      c.fwd_a = ud["fwd"].cast<py::tuple>()[0].cast<double>();
      c.fwd_b = ud["fwd"].cast<py::tuple>()[1].cast<double>();
      c.bwd_a = ud["bwd"].cast<py::tuple>()[0].cast<double>();
      c.bwd_b = ud["bwd"].cast<py::tuple>()[1].cast<double>();
      c.saved_a = ud["saved"].cast<py::tuple>()[0].cast<double>();
      c.saved_b = ud["saved"].cast<py::tuple>()[1].cast<double>();
      if (ud.contains("held")) {
        c.held_a = ud["held"].cast<py::tuple>()[0].cast<double>();
        c.held_b = ud["held"].cast<py::tuple>()[1].cast<double>();
      }
      c.out_a = ud["out"].cast<py::tuple>()[0].cast<double>();
      c.out_b = ud["out"].cast<py::tuple>()[1].cast<double>();
      c.input_share = get_or<double>(ud, "input_share", 0.5);
      c.split_cost = get_or<double>(ud, "split_cost", 1.0);
      c.shadow = get_or<double>(ud, "shadow", 0.0);
      c.param_bytes = ud["param_bytes"].cast<double>();
      c.param_numel = ud["param_numel"].cast<double>();
      c.param_tensors = ud["param_tensors"].cast<int64_t>();
      c.partial_grad_bytes = get_or<double>(ud, "partial_grad_bytes", 0.0);
      c.fwd_comm = to_comms(ud["fwd_comm"]);
      c.bwd_comm = to_comms(ud["bwd_comm"]);
      x.units.push_back(std::move(c));
    }
    TORCH_CHECK_VALUE(x.units.size() == p.units.size(), "eager problem: layout tp=", x.tp, " has ", x.units.size(),
                      " units, the model ", p.units.size());
    p.layouts.push_back(std::move(x));
  }
  for (const auto& c : d["comm"]) {
    const auto t = c.cast<py::tuple>();
    p.comm.push_back({t[0].cast<std::string>(), t[1].cast<int64_t>(), t[2].cast<double>(), t[3].cast<double>()});
  }
  for (const auto& s : d["schedules"]) {
    const auto sd = s.cast<py::dict>();
    eager::Schedule x;
    x.name = sd["name"].cast<std::string>();
    x.pp = sd["pp"].cast<int64_t>();
    x.microbatches = sd["microbatches"].cast<int64_t>();
    x.vp = sd["vp"].cast<int64_t>();
    x.placement = sd["placement"].cast<std::vector<int32_t>>();
    for (const auto& order : sd["orders"]) {
      std::vector<Action> o;
      for (const auto& a : order) {
        const auto t = a.cast<py::tuple>();
        o.push_back({t[0].cast<std::string>()[0], t[1].cast<int32_t>(), t[2].cast<int32_t>()});
      }
      x.orders.push_back(std::move(o));
    }
    p.schedules.push_back(std::move(x));
  }
  p.world = d["world"].cast<int64_t>();
  p.batch = d["batch"].cast<int64_t>();
  p.optimizer_per_tensor = get_or<double>(d, "optimizer_per_tensor", 0.0);
  p.optimizer_per_element = get_or<double>(d, "optimizer_per_element", 0.0);
  p.state_bytes_per_element = get_or<double>(d, "state_bytes_per_element", 8.0);
  p.master_bytes_per_element = get_or<double>(d, "master_bytes_per_element", 4.0);
  p.grad_bytes_per_param_byte = get_or<double>(d, "grad_bytes_per_param_byte", 1.0);
  p.glue_param_bytes = get_or<double>(d, "glue_param_bytes", 0.0);
  p.tied_param_bytes = get_or<double>(d, "tied_param_bytes", 0.0);
  p.bucket_bytes = get_or<double>(d, "bucket_bytes", 25.0 * (1 << 20));
  p.step_overhead = get_or<double>(d, "step_overhead", 0.0);
  p.cores = get_or<double>(d, "cores", 0.0);
  p.profiled_busy = get_or<int64_t>(d, "profiled_busy", 1);
  p.working_a = get_or<double>(d, "working_a", 0.0);
  p.working_b = get_or<double>(d, "working_b", 0.0);
  p.optimizer_temp_per_element = get_or<double>(d, "optimizer_temp_per_element", 0.0);
  p.copy_per_byte = get_or<double>(d, "copy_per_byte", 0.0);
  p.action_seconds = get_or<double>(d, "action_seconds", 0.0);
  p.gather_copies = get_or<double>(d, "gather_copies", 0.0);
  TORCH_CHECK_VALUE(p.world >= 1 && p.batch >= 1, "eager problem: world and batch must be >= 1");
  return p;
}

eager::Config to_eager_config(const py::dict& d) {
  eager::Config c;
  c.pp = get_or<int64_t>(d, "pp", 1);
  c.dp = get_or<int64_t>(d, "dp", 1);
  c.tp = get_or<int64_t>(d, "tp", 1);
  c.sp = get_or<bool>(d, "sp", false);
  c.zero = get_or<int>(d, "zero", 0);
  c.recompute = get_or<bool>(d, "recompute", false);
  c.schedule = get_or<std::string>(d, "schedule", "none");
  c.microbatches = get_or<int64_t>(d, "microbatches", 1);
  c.vp = get_or<int64_t>(d, "vp", 1);
  c.blocks_per_stage = get_or<std::vector<int64_t>>(d, "blocks_per_stage", {});
  return c;
}

py::dict from_eager(const eager::Estimate& e) {
  py::dict d;
  const auto& c = e.config;
  d["config"] = py::dict(py::arg("pp") = c.pp, py::arg("dp") = c.dp, py::arg("tp") = c.tp, py::arg("sp") = c.sp,
                         py::arg("zero") = c.zero, py::arg("recompute") = c.recompute,
                         py::arg("schedule") = c.schedule,
                         py::arg("microbatches") = c.microbatches, py::arg("vp") = c.vp,
                         py::arg("blocks_per_stage") = c.blocks_per_stage);
  d["label"] = c.str();
  d["feasible"] = e.feasible;
  d["reason"] = e.reason;
  d["verdict"] = e.verdict;
  d["step_s"] = e.step_s;
  d["bubble"] = e.bubble;
  const auto& b = e.breakdown;
  d["breakdown"] = py::dict(py::arg("compute") = b.compute, py::arg("tp_comm") = b.tp_comm,
                            py::arg("zero_comm") = b.zero_comm, py::arg("idle") = b.idle, py::arg("dp_comm") = b.dp_comm,
                            py::arg("pp_sync") = b.pp_sync, py::arg("optimizer") = b.optimizer, py::arg("other") = b.other);
  auto mem = [](const eager::Memory& m) {
    return py::dict(py::arg("params") = m.params, py::arg("grads") = m.grads, py::arg("optimizer") = m.optimizer,
                    py::arg("activations") = m.activations, py::arg("total") = m.total());
  };
  d["memory"] = mem(e.memory);
  py::list ranks;
  for (const auto& m : e.rank_memory) ranks.append(mem(m));
  d["rank_memory"] = ranks;
  d["stage_forward"] = e.stage_forward;
  d["stage_backward"] = e.stage_backward;
  py::list comms;
  for (const auto& x : e.rank0_comms)
    comms.append(py::dict(py::arg("kind") = x.kind, py::arg("group_size") = x.group, py::arg("bytes") = x.bytes,
                          py::arg("count") = x.count, py::arg("what") = x.what));
  d["rank0_comms"] = comms;
  return d;
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
  m.def("autoplan_orders", [](int32_t ranks, int32_t microbatches, int32_t virtual_stages, bool zero_bubble) {
    const Orders o = zero_bubble ? zb_h1(ranks, microbatches) : one_f_one_b(ranks, microbatches, virtual_stages);
    py::list out;
    for (const auto& order : o.orders) {
      py::list r;
      for (const auto& a : order) r.append(py::make_tuple(std::string(1, a.kind), a.stage, a.mb));
      out.append(r);
    }
    return out;
  }, "The C++ 1F1B / interleaved 1F1B / ZB-H1 orders (autoplan/schedule_orders.h), per rank (kind, stage, mb).",
  py::arg("ranks"), py::arg("microbatches"), py::arg("virtual_stages") = 1, py::arg("zero_bubble") = false);
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
  m.def("autoplan_eager_estimate", [](const py::dict& problem, const py::dict& config, const std::string& split,
                                      double memory_limit) {
    const auto p = to_problem(problem);
    const auto c = to_eager_config(config);
    eager::Estimate e;
    {
      py::gil_scoped_release release;
      e = eager::estimate(p, c, split, memory_limit);
    }
    return from_eager(e);
  }, py::arg("problem"), py::arg("config"), py::arg("split") = "time", py::arg("memory_limit") = 0.0,
     "One configuration under the eager planner's measured cost model (autoplan/eager.h).");
  m.def("autoplan_eager_search", [](const py::dict& problem, const py::dict& constraints) {
    const auto p = to_problem(problem);
    eager::Constraints k;
    k.pp = get_or<int64_t>(constraints, "pp", 0);
    k.dp = get_or<int64_t>(constraints, "dp", 0);
    k.tp = get_or<int64_t>(constraints, "tp", 0);
    k.zero = get_or<int>(constraints, "zero", -1);
    k.sp = get_or<int>(constraints, "sp", -1);
    k.recompute = get_or<int>(constraints, "recompute", -1);
    k.microbatches = get_or<int64_t>(constraints, "microbatches", 0);
    k.vp = get_or<int64_t>(constraints, "vp", 0);
    k.schedule = get_or<std::string>(constraints, "schedule", "");
    k.split = get_or<std::string>(constraints, "split", "time");
    k.memory_limit = get_or<double>(constraints, "memory_limit", 0.0);
    eager::Result r;
    {
      py::gil_scoped_release release;
      r = eager::search(p, k);
    }
    py::list ranked, rejected;
    for (const auto& e : r.ranked) ranked.append(from_eager(e));
    for (const auto& e : r.rejected) rejected.append(from_eager(e));
    py::dict d;
    d["ranked"] = ranked;
    d["rejected"] = rejected;
    d["enumerated"] = r.enumerated;
    d["seconds"] = r.seconds;
    return d;
  }, "The eager planner's search (autoplan/eager.h): every configuration the constraints allow, ranked.");
}

}  // namespace vescale::autoplan
