#pragma once
// The collective recorder: what the engine (and, through vescale.debug, the Python
// side: DDP buckets, ZeRO gathers, pipeline sends) sends, one event per collective or
// point-to-point transfer, with its group, size, time and the op that issued it.
//
// Off by default. Everything that observes the per-op path (this recorder,
// vescale.explain's capture, NaN/Inf detection) is switched on through one flag word,
// so that the per-op path pays one relaxed atomic load when nothing observes it.
//
// Sizes come from tensor metadata only (numel x element size): the recorder works the
// same on meta tensors over a fake process group, which is how the planner's what-if
// analysis reads off the collectives a plan would issue.

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace vescale::collectives::trace {

enum Flag : uint32_t {
  kCollectives = 1,  // record collectives (vescale.debug.comm_trace)
  kExplain = 2,      // capture per-op decisions (vescale.explain)
  kAnomaly = 4,      // check op results for NaN/Inf (vescale.debug.detect_anomaly)
};

namespace detail {
extern std::atomic<uint32_t> flags;
}

// The observers that are on (a Flag mask). The per-op path reads only this.
inline uint32_t flags() { return detail::flags.load(std::memory_order_relaxed); }
// Turns an observer on or off; counted, so that nested users of one flag compose.
void enable(Flag flag);
void disable(Flag flag);

struct CollectiveEvent {
  std::string kind;       // "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "send", "recv"
  std::string group;      // c10d group name
  int64_t group_size = 0;
  int32_t mesh_dim = -1;  // -1: not a mesh dim's group (e.g. a DDP group given as a process group)
  std::string mesh_dim_name;
  uint64_t bytes = 0;     // input bytes on this rank
  int64_t start_ns = 0;   // steady clock (CLOCK_MONOTONIC on Linux)
  int64_t end_ns = 0;
  std::string op;         // the aten op being dispatched when it was issued, or the API call
  int32_t scope = 0;      // the caller's scope id (vescale.debug.comm_trace: a module), 0 when none
  int64_t peer = -1;      // send / recv: the peer's rank within `group`
  std::string source;     // "engine" (C++) or the Python component that recorded it
};

int64_t now_ns();

// Appends to the process's record (when kCollectives is on) and to this thread's
// listener (when one is installed). Thread-safe.
void record(CollectiveEvent event);
// The record so far (a copy) and its reset. At most `max_events()` are kept; later ones
// are counted in `dropped()`.
std::vector<CollectiveEvent> events(size_t first = 0);  // from the `first`-th on
size_t event_count();
void clear_events();
size_t max_events();
uint64_t dropped();

// The op being dispatched on this thread while an observer is on (empty otherwise);
// nested dispatches (decompositions) name the innermost op.
const std::string& current_op();
class OpContext {
 public:
  explicit OpContext(const std::string& op);
  ~OpContext();
  OpContext(const OpContext&) = delete;
  OpContext& operator=(const OpContext&) = delete;

 private:
  const std::string* saved_;
};

// Names an API call (redistribute, distribute_tensor) as the op of the collectives it
// issues outside any op dispatch, while an observer is on.
class ApiContext {
 public:
  explicit ApiContext(const std::string& name);
  ~ApiContext();
  ApiContext(const ApiContext&) = delete;
  ApiContext& operator=(const ApiContext&) = delete;

 private:
  const std::string* saved_;
  bool set_;
};

// The scope id the Python tracer sets as modules enter and leave (process-wide: the
// forward and, on CPU, the backward run on the thread that called them).
int32_t scope();
void set_scope(int32_t scope);

// While alive, also collects the events issued on this thread (vescale.explain uses it
// to list the collectives one op issued). Nests.
class Listener {
 public:
  Listener();
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  std::vector<CollectiveEvent> events;

 private:
  Listener* saved_;
};
bool listening();

// Times one collective: when an observer is on at construction, records the event
// (start and end) when destroyed. `bytes` are the input bytes.
class Timed {
 public:
  Timed(const char* kind, const std::string& group, int64_t group_size, int32_t mesh_dim,
        const std::string* mesh_dim_name, uint64_t bytes);
  ~Timed();
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  bool on_;
  CollectiveEvent event_;
};

}  // namespace vescale::collectives::trace
