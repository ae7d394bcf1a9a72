// vescale._C: the thin binding layer the Python package calls into. Placements cross
// the boundary as tuples: ("R",), ("S", dim), ("P", "sum"), ("I", dim, groups).

#include "autoplan/pipeline_sim.h"
#include "collectives/collectives.h"
#include "collectives/redistribute_plan.h"
#include "collectives/trace.h"
#include "dispatch/api.h"
#include "dispatch/dtensor_impl.h"
#include "dispatch/fallback_stats.h"
#include "dispatch/handler.h"
#include "dispatch/loss_watch.h"
#include "dispatch/observe.h"
#include "dispatch/propagation.h"
#include "sharding_rules/mt_jump.h"
#include "sharding_rules/random_local.h"
#include "sharding_rules/rule.h"
#ifdef VESCALE_CUDA
#include "sharding_rules/random_local_cuda.h"
#endif

#include <torch/extension.h>

namespace py = pybind11;

namespace vescale::autoplan {
void bind_autoplan(py::module& m);  // bindings/autoplan.cpp
}

namespace vescale {

namespace trace = collectives::trace;

namespace {

Placements to_placements(const py::sequence& seq) {
  Placements out;
  for (const auto& item : seq) {
    auto t = item.cast<py::tuple>();
    const auto kind = t[0].cast<std::string>();
    if (kind == "R") out.push_back(Placement::replicate());
    else if (kind == "S") out.push_back(Placement::shard(t[1].cast<int32_t>()));
    else if (kind == "P") out.push_back(Placement::partial(parse_reduce_op(t[1].cast<std::string>())));
    else if (kind == "I") out.push_back(Placement::interleaved(t[1].cast<int32_t>(), t[2].cast<int32_t>()));
    else TORCH_CHECK_VALUE(false, "unknown placement kind '", kind, "'");
  }
  return out;
}

py::list from_placements(PlacementsRef placements) {
  py::list out;
  for (const auto& p : placements) {
    if (p.is_replicate()) out.append(py::make_tuple("R"));
    else if (p.is_shard()) out.append(py::make_tuple("S", p.dim));
    else if (p.is_interleaved()) out.append(py::make_tuple("I", p.dim, p.groups));
    else out.append(py::make_tuple("P", reduce_op_name(p.op)));
  }
  return out;
}

c10::DeviceType parse_device_type(const std::string& s) { return c10::Device(s).type(); }

const TensorSpec& spec_of(const at::Tensor& t) { return *checked_dtensor_impl(t, "spec")->spec(); }

py::dict event_dict(const trace::CollectiveEvent& e) {
  py::dict d;
  d["kind"] = e.kind;
  d["group"] = e.group;
  d["group_size"] = e.group_size;
  d["mesh_dim"] = e.mesh_dim;
  d["mesh_dim_name"] = e.mesh_dim_name;
  d["bytes"] = e.bytes;
  d["start_ns"] = e.start_ns;
  d["end_ns"] = e.end_ns;
  d["op"] = e.op;
  d["scope"] = e.scope;
  d["peer"] = e.peer;
  d["source"] = e.source;
  return d;
}

py::dict tensor_dict(const ExplainedTensor& t) {
  py::dict d;
  d["name"] = t.name;
  d["defined"] = t.defined;
  d["is_dtensor"] = t.is_dtensor;
  d["shape"] = std::vector<int64_t>(t.shape.begin(), t.shape.end());
  d["dtype"] = std::string(c10::toString(t.dtype));
  d["placements"] = from_placements(t.placements);
  d["target"] = from_placements(t.target);
  d["moves"] = t.moves;
  d["cost"] = t.cost;
  return d;
}

}  // namespace
}  // namespace vescale

PYBIND11_MODULE(_C, m) {
  using namespace vescale;
  m.doc() = "vescale C++ engine: DTensorImpl, dispatch handler, sharding rules, collectives";

  claim_composite_explicit_ops();

  py::class_<Mesh, std::shared_ptr<Mesh>>(m, "Mesh")
      .def(py::init([](std::vector<int64_t> shape, std::vector<int64_t> ranks,
                       std::vector<std::string> dim_names, std::vector<std::string> group_names,
                       std::vector<int64_t> coordinate, const std::string& device_type,
                       const std::string& flat_group_name) {
             Mesh mesh;
             mesh.shape = std::move(shape);
             mesh.ranks = std::move(ranks);
             mesh.dim_names = std::move(dim_names);
             mesh.group_names = std::move(group_names);
             mesh.coordinate = std::move(coordinate);
             mesh.device_type = parse_device_type(device_type);
             mesh.flat_group_name = flat_group_name;
             return std::const_pointer_cast<Mesh>(intern_mesh(std::move(mesh)));
           }),
           py::arg("shape"), py::arg("ranks"), py::arg("dim_names"), py::arg("group_names"),
           py::arg("coordinate"), py::arg("device_type"), py::arg("flat_group_name") = "")
      .def_property_readonly("shape", [](const Mesh& x) { return x.shape; })
      .def_property_readonly("ranks", [](const Mesh& x) { return x.ranks; })
      .def_property_readonly("dim_names", [](const Mesh& x) { return x.dim_names; })
      .def_property_readonly("group_names", [](const Mesh& x) { return x.group_names; })
      .def_property_readonly("coordinate", [](const Mesh& x) { return x.coordinate; })
      .def_property_readonly("flat_group_name", [](const Mesh& x) { return x.flat_group_name; })
      .def("__repr__", &Mesh::str)
      .def("__eq__", [](const Mesh& a, const Mesh& b) { return &a == &b; })
      .def("__hash__", [](const Mesh& a) { return std::hash<const void*>{}(&a); });

  auto spec_from = [](const std::shared_ptr<Mesh>& mesh, const py::sequence& placements,
                      std::vector<int64_t> shape, std::vector<int64_t> stride, at::ScalarType dtype) {
    return make_spec(mesh, to_placements(placements), shape, stride, dtype);
  };

  // Calls that may communicate release the GIL first (as torch's own c10d bindings
  // do): backend threads may need it to finish the collectives they wait on.
  // Local random draws on the default CPU generator (vescale/deferred.py replays fills
  // with them): a box of normal_(a, b) / uniform_(a, b) on a contiguous tensor of
  // `shape`, leaving the generator where the whole fill leaves it. False: not a fill
  // whose consumption is known (the caller draws the whole tensor). On a CUDA `out` (a
  // CUDA build): the default CUDA generator, `kind` any fill rng::cuda::handles.
  m.def("_rng_draw_box", [](const std::string& kind, double a, double b, std::vector<int64_t> shape,
                            std::vector<int64_t> offsets, std::vector<int64_t> sizes, at::Tensor out) {
    if (out.is_cuda()) {  // kind: the fill's op name; a, b: its parameters (rng::cuda::Fill)
#ifdef VESCALE_CUDA
      return rng::cuda::draw_box({kind, a, b}, std::nullopt, shape, offsets, sizes, out);
#else
      return false;
#endif
    }
    int64_t n = 1;
    for (auto s : shape) n *= s;
    const auto model = rng::model_for(kind, out.scalar_type(), n);
    if (!model.ok() || (kind != "normal_" && kind != "uniform_")) return false;
    auto* gen = at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
    const bool normal = kind == "normal_";
    rng::draw_box(gen, model, shape, offsets, sizes,
                  [=](at::Tensor& buf) { normal ? buf.normal_(a, b) : buf.uniform_(a, b); }, out);
    return true;
  });
  // native_dropout(whole, p) of a contiguous `shape` on CUDA, for the box at `offsets`
  // whose values `input` holds: (output, mask), or None where not handled.
  m.def("_rng_dropout_box", [](const at::Tensor& input, double p, std::vector<int64_t> shape,
                               std::vector<int64_t> offsets, std::vector<int64_t> sizes) -> py::object {
#ifdef VESCALE_CUDA
    at::Tensor output, mask;
    if (rng::cuda::dropout_box(input, p, shape, offsets, sizes, output, mask)) return py::make_tuple(output, mask);
#endif
    return py::none();
  });
  // Moves the default CPU generator past a whole fill of `numel` elements (False: unknown).
  m.def("_rng_skip", [](const std::string& kind, at::ScalarType dtype, int64_t numel) {
    const auto model = rng::model_for(kind, dtype, numel);
    if (!model.ok()) return false;
    rng::advance(at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator()),
                 static_cast<uint64_t>(model.consumption(numel)));
    return true;
  });
  // The default CPU generator n outputs on: "jump", "stream" or "auto" (bench/rng_jump.py).
  m.def("_rng_advance", [](uint64_t n, const std::string& how) {
    auto* gen = at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    auto engine = gen->engine();
    auto pod = engine.data();
    if (how == "jump") mt::jump(pod, n);
    else if (how == "stream") mt::stream(pod, n);
    else mt::advance(pod, n);
    engine.set_data(pod);
    gen->set_engine(engine);
  }, py::arg("n"), py::arg("how") = "auto");
  m.def("_rng_jump_threshold", &mt::jump_threshold);
  m.def("_live_dtensors", &DTensorImpl::live);
  m.def("_rng_drawn_elements", &rng::drawn_elements);
  m.def("_rng_reset_drawn_elements", &rng::reset_drawn_elements);
  m.def("loss_watch_start", &loss_watch::start);
  m.def("loss_watch_stop", &loss_watch::stop);
  m.def("loss_watch_total", &loss_watch::total_of);
  m.def("is_dtensor", [](const at::Tensor& t) { return is_dtensor(t); });
  m.def("from_local",
        [spec_from](const at::Tensor& local, const std::shared_ptr<Mesh>& mesh, const py::sequence& placements,
                    std::vector<int64_t> shape, std::vector<int64_t> stride) {
          auto spec = spec_from(mesh, placements, shape, stride, local.scalar_type());
          py::gil_scoped_release no_gil;
          return from_local(local, std::move(spec));
        });
  m.def("to_local", [](const at::Tensor& t, const std::optional<py::sequence>& grad_placements) {
    std::optional<Placements> g;
    if (grad_placements) g = to_placements(*grad_placements);
    py::gil_scoped_release no_gil;
    return to_local(t, g);
  });
  m.def("redistribute", [](const at::Tensor& t, const py::sequence& placements, bool async_op) {
    auto p = to_placements(placements);
    py::gil_scoped_release no_gil;
    return redistribute(t, p, async_op);
  }, py::arg("t"), py::arg("placements"), py::arg("async_op") = false);
  m.def("distribute_tensor", [](const at::Tensor& full, const std::shared_ptr<Mesh>& mesh,
                                const py::sequence& placements, std::optional<int64_t> src_rank) {
    auto p = to_placements(placements);
    py::gil_scoped_release no_gil;
    return distribute_tensor(full, mesh, p, src_rank);
  });
  m.def("shard_steps_may_differ", [](std::vector<int64_t> shape, const py::sequence& placements,
                                     std::vector<int64_t> mesh_shape) {
    return shard_steps_may_differ(shape, to_placements(placements), mesh_shape);
  });
  m.def("strides_of_mesh_rank", [](std::vector<int64_t> strides, const std::shared_ptr<Mesh>& mesh, int64_t src) {
    py::gil_scoped_release no_gil;
    return strides_of_mesh_rank(strides, *mesh, src);
  });
  m.def("align_grad_placements", [](const at::Tensor& t) { align_grad_placements(t); });
  m.def("defer_partial_grads", [](const at::Tensor& t) { defer_partial_grads(t); });
  m.def("relabel", [](const at::Tensor& t, const py::sequence& placements) { relabel(t, to_placements(placements)); });
  m.def("local_tensor", [](const at::Tensor& t) {
    return checked_dtensor_impl(t, "local_tensor")->local();
  }, "This rank's shard itself, outside autograd (internal use).");
  m.def("mesh_of", [](const at::Tensor& t) {
    return std::const_pointer_cast<Mesh>(spec_of(t).mesh);
  });
  m.def("simulate_pipeline",
        [](const std::string& name, const std::vector<std::vector<std::tuple<std::string, int32_t, int32_t>>>& orders,
           std::vector<int32_t> placement, int32_t microbatches,
           const std::vector<std::tuple<double, double, double, double>>& costs, std::vector<double> send_forward,
           std::vector<double> send_backward) {
          autoplan::PipelineModel model;
          model.name = name;
          for (const auto& order : orders) {
            auto& out = model.orders.emplace_back();
            for (const auto& [kind, stage, mb] : order) out.push_back({kind.at(0), stage, mb});
          }
          model.placement = std::move(placement);
          model.microbatches = microbatches;
          for (const auto& [f, b, i, w] : costs) model.costs.push_back({f, b, i, w});
          model.send_forward = std::move(send_forward);
          model.send_backward = std::move(send_backward);
          const auto timeline = autoplan::simulate_pipeline(model);
          py::list actions;
          for (const auto& t : timeline.actions)
            actions.append(py::make_tuple(std::string(1, t.action.kind), t.action.stage, t.action.mb, t.rank, t.start,
                                          t.end));
          py::dict out;
          out["makespan"] = timeline.makespan;
          out["bubble"] = timeline.bubble();
          out["busy"] = timeline.busy;
          out["actions"] = actions;
          return out;
        },
        "The pipeline timeline simulator (autoplan/pipeline_sim.h): per-rank orders of (kind, stage, mb) on a "
        "clock with per-stage (F, B, I, W) costs and per-boundary send times.");
  m.def("collective_counts", [] {
    py::dict out;
    for (const auto& c : collectives::collective_counts()) out[py::str(c.kind)] = py::make_tuple(c.calls, c.bytes);
    return out;
  }, "Collectives vescale issued since start-up or the last reset: {kind: (calls, bytes)}.");
  m.def("reset_collective_counts", &collectives::reset_collective_counts);

  // ---- vescale.debug: the collective recorder (collectives/trace.h) ----
  m.def("trace_collectives", [](bool on) { on ? trace::enable(trace::kCollectives) : trace::disable(trace::kCollectives); },
        "Turns the collective recorder on (counted: nested users compose) or off.");
  m.def("trace_recording", [] { return (trace::flags() & trace::kCollectives) != 0; });
  m.def("trace_events", [](size_t first) {
    py::list out;
    for (const auto& e : trace::events(first)) out.append(event_dict(e));
    return out;
  }, py::arg("first") = 0, "The recorded collectives from the `first`-th on, oldest first, as dicts.");
  m.def("trace_event_count", &trace::event_count);
  m.def("trace_clear", &trace::clear_events);
  m.def("trace_dropped", &trace::dropped);
  m.def("trace_max_events", &trace::max_events);
  m.def("trace_now_ns", &trace::now_ns, "The recorder's clock (steady, nanoseconds).");
  m.def("trace_scope", &trace::scope);
  m.def("trace_set_scope", &trace::set_scope);
  m.def("scope_id", &scope_id, py::arg("module"), py::arg("backward"));
  m.def("scope_name", &scope_name);
  m.def("trace_record",
        [](const std::string& kind, const std::string& group, int64_t group_size, uint64_t bytes, int64_t start_ns,
           int64_t end_ns, const std::string& op, int32_t scope, int64_t peer, const std::string& source,
           int32_t mesh_dim, const std::string& mesh_dim_name) {
          trace::CollectiveEvent e;
          e.kind = kind;
          e.group = group;
          e.group_size = group_size;
          e.bytes = bytes;
          e.start_ns = start_ns;
          e.end_ns = end_ns;
          e.op = op;
          e.scope = scope;
          e.peer = peer;
          e.source = source;
          e.mesh_dim = mesh_dim;
          e.mesh_dim_name = mesh_dim_name;
          trace::record(std::move(e));
        },
        py::arg("kind"), py::arg("group"), py::arg("group_size"), py::arg("bytes"), py::arg("start_ns"),
        py::arg("end_ns"), py::arg("op") = "", py::arg("scope") = 0, py::arg("peer") = -1,
        py::arg("source") = "python", py::arg("mesh_dim") = -1, py::arg("mesh_dim_name") = "");

  // ---- vescale.explain ----
  py::class_<OpExplanation, std::shared_ptr<OpExplanation>>(m, "OpExplanation")
      .def_readonly("op", &OpExplanation::op)
      .def_readonly("mesh", &OpExplanation::mesh)
      .def_property_readonly("how", [](const OpExplanation& e) {
        switch (e.how) {
          case OpExplanation::How::Rule: return "rule";
          case OpExplanation::How::Fallback: return "fallback";
          case OpExplanation::How::Decomposed: return "decomposed";
        }
        return "rule";
      })
      .def_readonly("fallback_reason", &OpExplanation::fallback_reason)
      .def_readonly("cache_hit", &OpExplanation::cache_hit)
      .def_readonly("depth", &OpExplanation::depth)
      .def_readonly("scope", &OpExplanation::scope)
      .def_property_readonly("inputs", [](const OpExplanation& e) {
        py::list out;
        for (const auto& t : e.inputs) out.append(tensor_dict(t));
        return out;
      })
      .def_property_readonly("outputs", [](const OpExplanation& e) {
        py::list out;
        for (const auto& t : e.outputs) out.append(tensor_dict(t));
        return out;
      })
      .def_property_readonly("candidates", [](const OpExplanation& e) {
        py::list out;
        for (size_t k = 0; k < e.candidates.candidates.size(); ++k) {
          const auto& c = e.candidates.candidates[k];
          py::dict d;
          py::list ins, outs;
          for (const auto& p : c.inputs) ins.append(from_placements(p));
          for (const auto& p : c.outputs) outs.append(from_placements(p));
          d["inputs"] = ins;
          d["outputs"] = outs;
          d["cost"] = c.cost;
          d["keeps_written"] = c.keeps_written;
          d["chosen"] = static_cast<int>(k) == e.candidates.chosen;
          d["str"] = to_string(c);
          out.append(d);
        }
        return out;
      })
      .def_property_readonly("collectives", [](const OpExplanation& e) {
        py::list out;
        for (const auto& c : e.collectives) out.append(event_dict(c));
        return out;
      })
      .def("__str__", &OpExplanation::str)
      .def("__repr__", &OpExplanation::str);
  m.def("explain_begin", &begin_explain_capture, py::arg("capacity"));
  m.def("explain_end", [](int64_t handle) {
    py::list out;
    for (const auto& e : end_explain_capture(handle)) out.append(std::const_pointer_cast<OpExplanation>(e));
    return out;
  });

  // ---- vescale.debug.detect_anomaly ----
  m.def("anomaly_begin", &begin_anomaly_detection, py::arg("raise_at_op"));
  m.def("anomaly_end", &end_anomaly_detection, py::arg("raise_at_op"));
  m.def("reset_anomaly", &reset_anomaly);
  m.def("first_anomaly", []() -> py::object {
    const auto a = first_anomaly();
    if (!a) return py::none();
    py::dict d;
    d["op"] = a->op;
    d["result"] = a->result;
    d["inputs_finite"] = a->inputs_finite;
    d["rank"] = a->rank;
    d["scope"] = a->scope;
    d["module"] = scope_name(a->scope);
    d["message"] = a->message;
    return d;
  });

  // ---- bounded global state ----
  m.def("cache_sizes", [] {
    const auto d = decision_cache_size();
    const auto s = spec_table_size();
    py::dict out;
    out["decisions"] = d.entries;
    out["decision_limit"] = d.limit;
    out["decision_evictions"] = d.evictions;
    out["spec_table"] = s.entries;
    out["specs"] = s.live;
    out["spec_sweep_min"] = s.min_sweep;
    return out;
  });
  m.def("set_decision_cache_limit", &set_decision_cache_limit);
  m.def("default_decision_cache_limit", &default_decision_cache_limit);
  m.def("placements_of", [](const at::Tensor& t) { return from_placements(spec_of(t).placements); });
  m.def("normalize_placements", [](const py::sequence& placements, int64_t ndim) {
    auto p = to_placements(placements);
    for (auto& x : p)
      if (x.splits()) x.dim = normalize_shard_dim(x.dim, ndim, "placement");
    return from_placements(p);
  });
  m.def("local_shape", [](std::vector<int64_t> shape, const py::sequence& placements,
                          std::vector<int64_t> mesh_shape, std::vector<int64_t> coordinate) {
    const auto box = local_box(shape, to_placements(placements), mesh_shape, coordinate);
    return py::make_tuple(std::vector<int64_t>(box.sizes.begin(), box.sizes.end()),
                          std::vector<int64_t>(box.offsets.begin(), box.offsets.end()));
  });
  m.def("plan_redistribution",
        [](const std::shared_ptr<Mesh>& mesh, const py::sequence& src, const py::sequence& dst,
           std::vector<int64_t> shape, at::ScalarType dtype) {
          const auto plan = collectives::plan_redistribution(*mesh, to_placements(src), to_placements(dst), shape, dtype);
          std::vector<std::string> steps;
          for (const auto& s : plan.steps) steps.push_back(s.str());
          return py::make_tuple(steps, plan.cost);
        });

  m.def("fallback_report", [] {
    py::list out;
    for (const auto& e : fallback_report()) out.append(py::make_tuple(e.op, e.count, e.reason));
    return out;
  });
  m.def("reset_fallback_counts", &reset_fallback_counts);
  m.def("clear_cache", &clear_decision_cache);
  m.def("cache_misses", &decision_cache_misses);
  m.def("rule_names", [] { return rules().names(); });
  m.def("missing_rule_ops", [] { return rules().missing(); });
  autoplan::bind_autoplan(m);
}
