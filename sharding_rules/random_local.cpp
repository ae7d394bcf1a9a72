#include "sharding_rules/random_local.h"

#include "sharding_rules/mt_jump.h"

#include <atomic>
#include <mutex>
#include <vector>

namespace vescale::rng {

namespace {

std::atomic<int64_t> g_drawn{0};

constexpr int64_t kChunk = int64_t{1} << 20;  // elements per buffer (a multiple of 16)

struct Cursor {
  at::CPUGeneratorImpl* gen;
  uint64_t pos = 0;  // outputs taken since the draw began
  void to(uint64_t target) {
    TORCH_INTERNAL_ASSERT(target >= pos, "vescale: random draw moved backwards");
    if (target > pos) advance(gen, target - pos);
    pos = target;
  }
};

struct Run {
  int64_t start, end, out;  // flat [start, end) of the whole tensor; offset in out
};

}  // namespace

int64_t DrawModel::consumption(int64_t n) const {
  return per_element * (n + ((tail && n % block) ? block : 0));
}

DrawModel model_for(const std::string& op, at::ScalarType dtype, int64_t numel, int64_t range) {
  DrawModel m;
  const bool wide = dtype == at::kDouble;
  if (op == "uniform_") {
    if (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16)
      m.per_element = wide ? 2 : 1;
  } else if (op == "normal_") {
    if ((dtype == at::kFloat || dtype == at::kDouble) && numel >= 16) {
      m.per_element = wide ? 2 : 1;
      m.block = 16;
      m.tail = true;
    }
  } else if (op == "bernoulli_.float") {
    if (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16 ||
        dtype == at::kBool)
      m.per_element = 2;
  } else if (op == "random_") {
    if (dtype == at::kFloat || dtype == at::kInt || dtype == at::kShort || dtype == at::kByte || dtype == at::kChar ||
        dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kBool)
      m.per_element = 1;
    else if (dtype == at::kDouble || dtype == at::kLong)
      m.per_element = 2;
  } else if (op == "random_.to" || op == "random_.from") {
    if (range > 0) m.per_element = range >= (int64_t{1} << 32) ? 2 : 1;
  }
  return m;
}

void advance(at::CPUGeneratorImpl* gen, uint64_t n) {
  if (!n) return;
  std::lock_guard<std::mutex> lock(gen->mutex_);
  auto engine = gen->engine();
  auto pod = engine.data();
  mt::advance(pod, n);
  engine.set_data(pod);
  gen->set_engine(engine);
}

int64_t drawn_elements() { return g_drawn.load(); }
void reset_drawn_elements() { g_drawn.store(0); }
void count_drawn(int64_t n) { g_drawn += n; }

void draw_box(at::CPUGeneratorImpl* gen, const DrawModel& model, at::IntArrayRef shape, at::IntArrayRef offsets,
              at::IntArrayRef sizes, const Fill& fill, at::Tensor& out) {
  TORCH_INTERNAL_ASSERT(model.ok() && out.is_contiguous());
  const int64_t ndim = static_cast<int64_t>(shape.size());
  int64_t n = 1, box_n = 1;
  for (int64_t d = 0; d < ndim; ++d) {
    n *= shape[d];
    box_n *= sizes[d];
  }
  const int64_t per = model.per_element, B = model.block;
  Cursor cur{gen};
  const uint64_t total = static_cast<uint64_t>(model.consumption(n));
  if (box_n == 0 || n == 0) {
    cur.to(total);
    return;
  }
  // the box as row-major runs: dims after the last partial one are whole
  int64_t split = -1;
  for (int64_t d = 0; d < ndim; ++d)
    if (sizes[d] != shape[d]) split = d;
  int64_t run_len = 1;
  for (int64_t d = std::max<int64_t>(split, 0); d < ndim; ++d) run_len *= (d == split ? sizes[d] : shape[d]);
  if (split < 0) run_len = n;
  std::vector<int64_t> stride(static_cast<size_t>(ndim), 1);
  for (int64_t d = ndim - 2; d >= 0; --d) stride[d] = stride[d + 1] * shape[d + 1];
  std::vector<Run> runs;
  {
    std::vector<int64_t> idx(static_cast<size_t>(std::max<int64_t>(split, 0)), 0);
    int64_t o = 0;
    while (true) {
      int64_t start = 0;
      for (int64_t d = 0; d < ndim; ++d) start += (offsets[d] + (d < split ? idx[d] : 0)) * stride[d];
      runs.push_back({start, start + run_len, o});
      o += run_len;
      int64_t d = split - 1;
      while (d >= 0 && ++idx[d] == sizes[d]) idx[d--] = 0;
      if (d < 0) break;
    }
  }
  const int64_t main_end = (model.tail && n % B) ? n - B : n;   // elements drawn in groups
  const int64_t groups_end = (n / B) * B;                      // where the groups stop
  auto out_flat = out.view({-1});
  const auto options = out.options();
  // one chunk per dtype, kept between draws: allocating and freeing chunk-sized buffers
  // between the shards being kept fragments the heap (resident memory grows)
  // (leaked on purpose: no destructor runs after torch's at exit)
  static thread_local auto* kept = new std::vector<at::Tensor>(static_cast<size_t>(at::ScalarType::NumOptions));
  at::Tensor& buf = (*kept)[static_cast<size_t>(out.scalar_type())];
  auto draw_segment = [&](int64_t s0, int64_t s1, size_t r0, size_t r1) {
    if (r1 == r0 + 1 && runs[r0].start == s0 && runs[r0].end >= s1) {
      // one run, starting on a group: the fill writes straight into the box (no copy);
      // anything past main_end it writes is the tail's, overwritten below
      cur.to(static_cast<uint64_t>(s0 * per));
      auto piece = out_flat.narrow(0, runs[r0].out, s1 - s0);
      fill(piece);
      g_drawn += s1 - s0;
      cur.pos = static_cast<uint64_t>(s1 * per);
      return;
    }
    for (int64_t c0 = s0; c0 < s1; c0 += kChunk) {
      const int64_t c1 = std::min(c0 + kChunk, s1);
      cur.to(static_cast<uint64_t>(c0 * per));
      if (!buf.defined() || buf.numel() < c1 - c0) buf = at::empty({std::min(kChunk, std::max(c1 - c0, 2 * (buf.defined() ? buf.numel() : 0)))}, options);
      auto piece = buf.narrow(0, 0, c1 - c0);
      fill(piece);
      g_drawn += c1 - c0;
      cur.pos = static_cast<uint64_t>(c1 * per);
      for (size_t r = r0; r < r1; ++r) {
        const int64_t a = std::max(runs[r].start, c0), e = std::min({runs[r].end, c1, main_end});
        if (a < e) out_flat.narrow(0, runs[r].out + (a - runs[r].start), e - a).copy_(piece.narrow(0, a - c0, e - a));
      }
    }
  };
  // main part: merge runs whose aligned ranges lie close, draw each merged segment
  // (a segment costs about 1.3 us to start, the time to draw some 500 elements; skipping
  // costs 0.1 ns per output: runs closer than 256 elements are drawn through)
  const int64_t merge_gap = std::max<int64_t>(B, 256 / per);
  int64_t s0 = -1, s1 = -1;
  size_t r0 = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    const int64_t e = std::min(runs[r].end, main_end);
    if (runs[r].start >= e) continue;
    const int64_t a0 = runs[r].start / B * B, e0 = std::min((e + B - 1) / B * B, groups_end);
    if (s0 >= 0 && a0 <= s1 + merge_gap) {
      s1 = std::max(s1, e0);
      continue;
    }
    if (s0 >= 0) draw_segment(s0, s1, r0, r);
    s0 = a0;
    s1 = e0;
    r0 = r;
  }
  if (s0 >= 0) draw_segment(s0, s1, r0, runs.size());
  // the last B elements, redrawn after the whole tensor's groups
  if (main_end < n && runs.back().end > main_end) {
    cur.to(static_cast<uint64_t>(n * per));
    auto piece = at::empty({B}, options);
    fill(piece);
    g_drawn += B;
    cur.pos = static_cast<uint64_t>((n + B) * per);
    for (const auto& run : runs) {
      const int64_t a = std::max(run.start, main_end), e = run.end;
      if (a < e) out_flat.narrow(0, run.out + (a - run.start), e - a).copy_(piece.narrow(0, a - main_end, e - a));
    }
  }
  cur.to(total);
}

}  // namespace vescale::rng
