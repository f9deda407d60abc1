// Test code: runs an emulated Metal kernel over its grid (see metal_emulation.h).
// Reads a job file written by emulator.py, writes the output buffer back.
#pragma once

#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>

namespace metal_emu {

struct Attrs {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threadgroups_per_grid, threads_per_threadgroup, threads_per_grid, grid_origin;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup, threads_per_simdgroup;
  uint thread_index_in_quadgroup, quadgroup_index_in_threadgroup, quadgroups_per_threadgroup;
};

// One kernel argument: an array (exact-size heap buffer, so AddressSanitizer sees overruns)
// or a scalar.
struct Input {
  char* data = nullptr;  // buffer start; the kernel gets data + offset elements
  size_t nbytes = 0, itemsize = 0;
  int64_t offset = 0;
  std::vector<int> shape;
  std::vector<int64_t> strides;
  int ndim = 0;
  int32_t i32 = 0;
  float f32 = 0.0f;
  template <class T>
  T* ptr() { return reinterpret_cast<T*>(data) + offset; }
};

struct Job {
  int config = 0;
  uint3 grid{}, tg{};
  unsigned seed = 0;
  std::vector<Input> inputs;
  std::string out_path;
  char* out = nullptr;
  size_t out_nbytes = 0;
  template <class T>
  T* out_ptr() { return reinterpret_cast<T*>(out); }
};

[[noreturn]] inline void die(const std::string& msg) {
  std::fprintf(stderr, "launcher: %s\n", msg.c_str());
  std::_Exit(2);
}

inline char* read_file(const std::string& path, size_t nbytes) {
  char* buf = static_cast<char*>(std::malloc(nbytes ? nbytes : 1));
  std::ifstream f(path, std::ios::binary);
  if (!f.read(buf, std::streamsize(nbytes))) die("cannot read " + path);
  return buf;
}

// Job file: whitespace-separated records, see emulator.py:_write_job.
inline Job read_job(const std::string& path) {
  std::ifstream f(path);
  if (!f) die("cannot open job " + path);
  Job job;
  std::string key;
  while (f >> key) {
    if (key == "config") {
      f >> job.config;
    } else if (key == "grid") {
      f >> job.grid.x >> job.grid.y >> job.grid.z;
    } else if (key == "threadgroup") {
      f >> job.tg.x >> job.tg.y >> job.tg.z;
    } else if (key == "seed") {
      f >> job.seed;
    } else if (key == "array") {
      Input in;
      std::string file;
      f >> file >> in.nbytes >> in.itemsize >> in.offset >> in.ndim;
      in.shape.resize(in.ndim);
      in.strides.resize(in.ndim);
      for (auto& s : in.shape) f >> s;
      for (auto& s : in.strides) f >> s;
      in.data = read_file(file, in.nbytes);
      job.inputs.push_back(std::move(in));
    } else if (key == "int") {
      Input in;
      f >> in.i32;
      job.inputs.push_back(std::move(in));
    } else if (key == "float") {
      Input in;
      f >> in.f32;
      job.inputs.push_back(std::move(in));
    } else if (key == "output") {
      f >> job.out_path >> job.out_nbytes;
      job.out = static_cast<char*>(std::malloc(job.out_nbytes));
      std::memset(job.out, 0xff, job.out_nbytes);  // NaN-like fill: unwritten outputs show up
    } else {
      die("unknown job record " + key);
    }
  }
  return job;
}

inline void write_output(Job& job) {
  std::ofstream f(job.out_path, std::ios::binary);
  f.write(job.out, std::streamsize(job.out_nbytes));
  for (auto& in : job.inputs) std::free(in.data);
  std::free(job.out);
}

// Runs `kernel` once per GPU thread: threadgroups one at a time in a shuffled order, all the
// threads of a threadgroup at once (one OS thread each).
inline void run_grid(const Job& job, const std::function<void(const Attrs&)>& kernel) {
  const uint3 t = job.tg, g = job.grid;
  const int threads = int(t.x * t.y * t.z);
  if (threads <= 0 || threads % 32) die("threadgroup size must be a positive multiple of 32");
  if (g.x % t.x || g.y % t.y || g.z % t.z) die("grid must be a multiple of the threadgroup");
  const uint3 groups{g.x / t.x, g.y / t.y, g.z / t.z};
  std::vector<uint3> order;
  for (uint z = 0; z < groups.z; ++z)
    for (uint y = 0; y < groups.y; ++y)
      for (uint x = 0; x < groups.x; ++x) order.push_back(uint3{x, y, z});
  std::mt19937 rng(job.seed);
  std::shuffle(order.begin(), order.end(), rng);

  g_group.threads = threads;
  g_group.bar = std::make_unique<std::barrier<>>(threads);
  g_group.sites.assign(threads, Site{0, 0});
  g_group.simd.clear();
  for (int s = 0; s < threads / 32; ++s) g_group.simd.push_back(std::make_unique<Simdgroup>());
  std::barrier<> between(threads);

  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    long last = -1;
    int still = 0;
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      long now = g_progress.load();
      still = (now == last) ? still + 1 : 0;
      last = now;
      if (still >= 600) fail("deadlock: a barrier or simd function is not reached by all its threads", 0, 0, -1);
    }
  });

  std::vector<std::thread> pool;
  for (int tid = 0; tid < threads; ++tid) {
    pool.emplace_back([&, tid] {
      for (const uint3& b : order) {
        reset_thread(tid);
        Attrs a{};
        const uint x = uint(tid) % t.x, y = (uint(tid) / t.x) % t.y, z = uint(tid) / (t.x * t.y);
        a.thread_position_in_threadgroup = uint3{x, y, z};
        a.threadgroup_position_in_grid = b;
        a.thread_position_in_grid = uint3{b.x * t.x + x, b.y * t.y + y, b.z * t.z + z};
        a.threadgroups_per_grid = groups;
        a.threads_per_threadgroup = t;
        a.threads_per_grid = g;
        a.grid_origin = uint3{0, 0, 0};
        a.thread_index_in_threadgroup = uint(tid);
        a.thread_index_in_simdgroup = uint(tid % 32);
        a.simdgroup_index_in_threadgroup = uint(tid / 32);
        a.simdgroups_per_threadgroup = uint(threads / 32);
        a.threads_per_simdgroup = 32;
        a.thread_index_in_quadgroup = uint(tid % 4);
        a.quadgroup_index_in_threadgroup = uint(tid / 4);
        a.quadgroups_per_threadgroup = uint(threads / 4);
        kernel(a);
        between.arrive_and_wait();
        g_progress.fetch_add(1, std::memory_order_relaxed);
      }
    });
  }
  for (auto& th : pool) th.join();
  done = true;
  watchdog.join();
}

}  // namespace metal_emu
