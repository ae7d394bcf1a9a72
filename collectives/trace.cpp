#include "collectives/trace.h"

#include <c10/util/Exception.h>

#include <array>
#include <chrono>
#include <mutex>

namespace vescale::collectives::trace {

namespace detail {
std::atomic<uint32_t> flags{0};
}

namespace {

constexpr size_t kFlagBits = 3;
std::mutex g_flag_mu;
std::array<int64_t, kFlagBits> g_users{};  // per flag bit: how many have it on

size_t bit_index(Flag f) {
  switch (f) {
    case kCollectives: return 0;
    case kExplain: return 1;
    case kAnomaly: return 2;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown trace flag ", static_cast<uint32_t>(f));
}

std::mutex g_events_mu;
std::vector<CollectiveEvent> g_events;
std::atomic<uint64_t> g_dropped{0};
// A million events (a few hundred MB at most) bound a trace left on by mistake.
constexpr size_t kMaxEvents = 1 << 20;

std::atomic<int32_t> g_scope{0};

const std::string& empty_string() {
  static const std::string s;
  return s;
}

thread_local const std::string* t_op = nullptr;
thread_local Listener* t_listener = nullptr;

}  // namespace

void enable(Flag flag) {
  std::lock_guard<std::mutex> lock(g_flag_mu);
  if (g_users[bit_index(flag)]++ == 0) detail::flags.fetch_or(flag, std::memory_order_relaxed);
}

void disable(Flag flag) {
  std::lock_guard<std::mutex> lock(g_flag_mu);
  auto& users = g_users[bit_index(flag)];
  if (users == 0) return;
  if (--users == 0) detail::flags.fetch_and(~static_cast<uint32_t>(flag), std::memory_order_relaxed);
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void record(CollectiveEvent event) {
  if (t_listener != nullptr) t_listener->events.push_back(event);
  if ((flags() & kCollectives) == 0) return;
  std::lock_guard<std::mutex> lock(g_events_mu);
  if (g_events.size() >= kMaxEvents) {
    g_dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  g_events.push_back(std::move(event));
}

std::vector<CollectiveEvent> events(size_t first) {
  std::lock_guard<std::mutex> lock(g_events_mu);
  if (first >= g_events.size()) return {};
  return std::vector<CollectiveEvent>(g_events.begin() + static_cast<std::ptrdiff_t>(first), g_events.end());
}

size_t event_count() {
  std::lock_guard<std::mutex> lock(g_events_mu);
  return g_events.size();
}

void clear_events() {
  std::lock_guard<std::mutex> lock(g_events_mu);
  g_events.clear();
  g_events.shrink_to_fit();
  g_dropped = 0;
}

size_t max_events() { return kMaxEvents; }
uint64_t dropped() { return g_dropped.load(std::memory_order_relaxed); }

const std::string& current_op() { return t_op != nullptr ? *t_op : empty_string(); }

OpContext::OpContext(const std::string& op) : saved_(t_op) { t_op = &op; }
OpContext::~OpContext() { t_op = saved_; }

ApiContext::ApiContext(const std::string& name)
    : saved_(t_op), set_(flags() != 0 && t_op == nullptr) {
  if (set_) t_op = &name;
}
ApiContext::~ApiContext() {
  if (set_) t_op = saved_;
}

int32_t scope() { return g_scope.load(std::memory_order_relaxed); }
void set_scope(int32_t scope) { g_scope.store(scope, std::memory_order_relaxed); }

Listener::Listener() : saved_(t_listener) { t_listener = this; }
Listener::~Listener() { t_listener = saved_; }
bool listening() { return t_listener != nullptr; }

Timed::Timed(const char* kind, const std::string& group, int64_t group_size, int32_t mesh_dim,
             const std::string* mesh_dim_name, uint64_t bytes)
    : on_(flags() != 0 && ((flags() & kCollectives) != 0 || t_listener != nullptr)) {
  if (!on_) return;
  event_.kind = kind;
  event_.group = group;
  event_.group_size = group_size;
  event_.mesh_dim = mesh_dim;
  if (mesh_dim_name != nullptr) event_.mesh_dim_name = *mesh_dim_name;
  event_.bytes = bytes;
  event_.op = current_op();
  event_.scope = scope();
  event_.source = "engine";
  event_.start_ns = now_ns();
}

Timed::~Timed() {
  if (!on_) return;
  event_.end_ns = now_ns();
  record(std::move(event_));
}

}  // namespace vescale::collectives::trace
