#include "tools/bench/roofline.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/thread_pool.h"
#include "tools/bench/probes.h"

#if defined(MOE_HAVE_DNNL)
#include "oneapi/dnnl/dnnl.hpp"
#endif

namespace moe::bench {

ReadProbe::ReadProbe(int threads, size_t bytes)
    : threads_(threads),
      bytes_(bytes / 4096 * 4096),
      buffer_(static_cast<uint8_t*>(std::aligned_alloc(4096, bytes_))),
      pool_(std::make_unique<ThreadPool>(threads)) {
  // Touch every page first (first-touch by the threads that will read them).
  pool_->ParallelFor(static_cast<int64_t>(bytes_ / 4096), [&](int64_t b, int64_t e, int) {
    for (int64_t p = b; p < e; ++p)
      std::memset(buffer_ + p * 4096, static_cast<int>(p & 0xff), 4096);
  });
}

ReadProbe::~ReadProbe() { std::free(buffer_); }

double ReadProbe::Measure(int repeats) {
  std::vector<double> gbps;
  std::vector<uint64_t> sums(threads_);
  const StreamReadFn read = StreamReadKernel(nullptr);
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool_->ParallelFor(static_cast<int64_t>(bytes_ / 4096), [&](int64_t b, int64_t e, int t) {
      sums[t] += read(buffer_ + b * 4096, (e - b) * 4096);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gbps.push_back(static_cast<double>(bytes_) / s / 1e9);
  }
  return *std::max_element(gbps.begin(), gbps.end()) + 0 * static_cast<double>(sums[0] & 1);
}

HostCpu DescribeHostCpu() {
  HostCpu host;
  std::ifstream in("/proc/cpuinfo");
  std::set<std::string> flags;
  std::string vendor, family, model;
  for (std::string line; std::getline(in, line);) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key(absl::StripAsciiWhitespace(line.substr(0, colon)));
    const std::string value(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    if (key == "model name" && host.model.empty()) host.model = value;
    if (key == "vendor_id" && vendor.empty()) vendor = value;
    if (key == "cpu family" && family.empty()) family = value;
    if (key == "model" && model.empty()) model = value;
    if (key != "flags" || !flags.empty()) continue;
    for (absl::string_view f : absl::StrSplit(value, ' ', absl::SkipEmpty()))
      if (f == "avx2" || f == "fma" || f == "f16c" || absl::StartsWith(f, "avx512") ||
          absl::StartsWith(f, "amx"))
        flags.insert(std::string(f));
  }
  host.flags = absl::StrJoin(flags, " ");
  host.vendor = absl::StrCat(vendor, " family ", family, " model ", model);
  return host;
}

double MeasureReadBandwidth(int threads, size_t bytes, int repeats) {
  return ReadProbe(threads, bytes).Measure(repeats);
}

void FlushCaches() {
  static std::vector<uint8_t> buffer(size_t{256} << 20);  // >> any L3 we run on
  static uint8_t pass = 0;
  ++pass;
  for (size_t i = 0; i < buffer.size(); i += 64) buffer[i] = static_cast<uint8_t>(buffer[i] + pass);
}

double MeasureGemmGflops(bool bf16, std::string* source) {
#if defined(MOE_HAVE_DNNL)
  using dnnl::memory;
  // oneDNN reports a matmul this CPU cannot run (bf16 before AVX-512) by throwing.
  try {
    const memory::dim n = 2048;
    dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    dnnl::stream stream(engine);
    const auto dt = bf16 ? memory::data_type::bf16 : memory::data_type::f32;
    memory::desc a_md({n, n}, dt, memory::format_tag::ab);
    memory::desc b_any({n, n}, dt, memory::format_tag::any);
    memory::desc b_md({n, n}, dt, memory::format_tag::ab);
    memory::desc c_md({n, n}, memory::data_type::f32, memory::format_tag::ab);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_any, c_md), engine);
    memory a(a_md, engine), b_plain(b_md, engine), b(pd.weights_desc(), engine), c(c_md, engine);
    std::memset(a.get_data_handle(), 0x3c, a_md.get_size());  // small finite values in every dtype
    std::memset(b_plain.get_data_handle(), 0x3c, b_md.get_size());
    dnnl::reorder(b_plain, b).execute(stream, b_plain, b);
    dnnl::matmul gemm(pd);
    double best = 0;
    for (int r = 0; r < 6; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      gemm.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
      stream.wait();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) best = std::max(best, 2.0 * n * n * n / s / 1e9);
    }
    if (source != nullptr) *source = std::string("oneDNN matmul ") + pd.impl_info_str();
    return best;
  } catch (const dnnl::error& e) {
    if (source != nullptr)
      *source =
          std::string("oneDNN: no ") + (bf16 ? "bf16" : "fp32") + " matmul here (" + e.what() + ")";
    return 0;
  }
#else
  if (source != nullptr) *source = "none (built without oneDNN)";
  (void)bf16;
  return 0;
#endif
}

double MeasureComputePeak(int threads, const std::string& tier, bool bf16_mode, std::string* what) {
  const ComputeLoop loop = ComputeLoopFor(tier, bf16_mode);
  if (what != nullptr) *what = loop.what;
  ThreadPool pool(threads);
  std::vector<float> sink(pool.num_threads());
  auto run = [&](int64_t iters) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.RunOnAll([&](int t) { sink[t] += loop.run(iters); });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  // Calibrate to ~50 ms a pass, then the best of 7 passes (a roofline is what the machine can
  // do; on a shared host the slower passes measure the neighbours).
  int64_t iters = 1 << 14;
  while (run(iters) < 0.01 && iters < (int64_t{1} << 34)) iters *= 4;
  const double seconds = run(iters);
  iters = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(iters) * 0.05 / seconds));
  double best = 0;
  for (int r = 0; r < 7; ++r)
    best = std::max(best, loop.flops_per_iter * static_cast<double>(iters) * pool.num_threads() /
                              run(iters) / 1e9);
  return best + 0 * static_cast<double>(sink[0]);
}

Roofline MeasureRoofline(int threads, double buffer_gb, const std::string& tier, bool bf16_mode,
                         bool gemm) {
  Roofline r;
  StreamReadKernel(&r.read_kernel);
  r.read_gbps = MeasureReadBandwidth(threads, static_cast<size_t>(buffer_gb * (1 << 30)), 7);
  r.peak_gflops = MeasureComputePeak(threads, tier, bf16_mode, &r.peak_source);
  if (!gemm) {
    r.gemm_source = "not measured";
    return r;
  }
  r.bf16_gflops = MeasureGemmGflops(true, &r.gemm_source);
  r.fp32_gflops = MeasureGemmGflops(false, nullptr);
  return r;
}

}  // namespace moe::bench
