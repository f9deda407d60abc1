// Test code: just enough Metal for g++ to compile and run an mx.fast.metal_kernel body on a CPU.
//
// One OS thread per GPU thread, threadgroups one after another, real barriers:
// - threadgroup_barrier: a std::barrier over the threadgroup's threads;
// - simd_sum / simd_max / simdgroup_barrier: a std::barrier over the 32 lanes of the simdgroup,
//   values exchanged through per-lane slots.
// Every barrier and simdgroup function checks that all its threads reached it from the same
// source line the same number of times; divergence or a missed barrier aborts with a message
// (a watchdog reports a deadlock). This is stricter than a GPU, where a simd function in
// divergent code reduces over the active lanes only.
//
// Not faithful, by design (see docs/architecture.md, "The block attention kernel"):
// - simd_sum adds in a fixed pairwise order; the GPU's order is unspecified, so results agree
//   to rounding, not bit for bit. metal::exp is std::exp (not Metal's exp).
// - `threadgroup` variables become function statics shared by the running threadgroup; the
//   launcher runs threadgroups one at a time (in a shuffled order, so a read of memory another
//   threadgroup left behind shows up as a wrong result).
// - bfloat16_t is a 16-bit struct converted with round-to-nearest-even, half is _Float16.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <source_location>
#include <thread>
#include <vector>

typedef unsigned int uint;
struct uint3 {
  uint x, y, z;
};
using half = _Float16;
using float16_t = _Float16;

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40u);  // quiet NaN
    } else {
      bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  explicit operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
using bfloat = bfloat16_t;

namespace metal_emu {

[[noreturn]] inline void fail(const char* what, int line_a, int line_b, int who) {
  std::fprintf(stderr, "metal_emulation: %s (line %d vs line %d, thread %d)\n", what, line_a, line_b, who);
  std::fflush(stderr);
  std::_Exit(3);
}

struct Site {
  int line;
  long count;
  bool operator!=(const Site& o) const { return line != o.line || count != o.count; }
};

struct Simdgroup {
  std::barrier<> bar{32};
  float vals[32];
  Site sites[32];
};

// Synchronisation state of the threadgroup that is running.
struct Group {
  int threads = 0;
  std::unique_ptr<std::barrier<>> bar;
  std::vector<Site> sites;
  std::vector<std::unique_ptr<Simdgroup>> simd;
};

inline Group g_group;
inline std::atomic<long> g_progress{0};
inline thread_local int tl_tid = 0;
inline thread_local int tl_lane = 0;
inline thread_local int tl_simd = 0;
inline thread_local long tl_barriers = 0;
inline thread_local long tl_simd_ops = 0;

inline void reset_thread(int tid) {
  tl_tid = tid;
  tl_lane = tid % 32;
  tl_simd = tid / 32;
  tl_barriers = 0;
  tl_simd_ops = 0;
}

// All 32 lanes post a value from the same call site, then each reads every slot.
template <class Op>
inline float simd_exchange(float x, Op op, const char* name, int line) {
  Simdgroup& s = *g_group.simd[tl_simd];
  s.vals[tl_lane] = x;
  s.sites[tl_lane] = Site{line, ++tl_simd_ops};
  s.bar.arrive_and_wait();
  for (int l = 0; l < 32; ++l) {
    if (s.sites[l] != s.sites[tl_lane]) {
      fail(name, s.sites[tl_lane].line, s.sites[l].line, tl_simd * 32 + l);
    }
  }
  float v[32];
  std::copy(s.vals, s.vals + 32, v);
  for (int w = 16; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) v[i] = op(v[i], v[i + w]);
  }
  s.bar.arrive_and_wait();
  g_progress.fetch_add(1, std::memory_order_relaxed);
  return v[0];
}

}  // namespace metal_emu

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

inline float exp(float x) { return std::exp(x); }
template <class T>
inline T max(T a, T b) { return a < b ? b : a; }
template <class T>
inline T min(T a, T b) { return b < a ? b : a; }

inline float simd_sum(float x, std::source_location loc = std::source_location::current()) {
  return metal_emu::simd_exchange(x, [](float a, float b) { return a + b; },
                                  "simd_sum reached divergently", int(loc.line()));
}

inline float simd_max(float x, std::source_location loc = std::source_location::current()) {
  return metal_emu::simd_exchange(x, [](float a, float b) { return a < b ? b : a; },
                                  "simd_max reached divergently", int(loc.line()));
}

inline void simdgroup_barrier(mem_flags, std::source_location loc = std::source_location::current()) {
  metal_emu::simd_exchange(0.0f, [](float a, float) { return a; },
                           "simdgroup_barrier reached divergently", int(loc.line()));
}

inline void threadgroup_barrier(mem_flags, std::source_location loc = std::source_location::current()) {
  using namespace metal_emu;
  g_group.sites[tl_tid] = Site{int(loc.line()), ++tl_barriers};
  g_group.bar->arrive_and_wait();
  if (tl_tid == 0) {
    for (int t = 0; t < g_group.threads; ++t) {
      if (g_group.sites[t] != g_group.sites[0]) {
        fail("threadgroup_barrier not reached by every thread alike", g_group.sites[0].line,
             g_group.sites[t].line, t);
      }
    }
  }
  g_group.bar->arrive_and_wait();
  g_progress.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace metal

using namespace metal;

// Address-space qualifiers: plain C++ for device/constant/thread memory; threadgroup memory is
// function-static (shared by the threads of the one running threadgroup). The generated file
// #undefs these after the kernel.
#define device
#define constant
#define thread
#define threadgroup static
