// ggml-experts-bench: llama.cpp's CPU MoE path for the routed experts, timed on this host, as the
// reference point for `moe-bench layer`'s experts stage (the ggml pairing of docs/PERFORMANCE.md).
//
// The graph is the one llama.cpp builds for a MoE FFN: ggml_mul_mat_id for the gate and up
// projections of every (token, expert) pair, SwiGLU, ggml_mul_mat_id for the down projection,
// then the routing weights and the sum over each token's experts. Weights are MXFP4 with random
// codes and scales (ggml multiplies them with int8-quantized activations, which our numerics
// contract forbids); each timed run routes every token to top-k distinct experts drawn afresh,
// after a pass over a 256 MB buffer that evicts the caches, as moe-bench does.
//
// Built against a ggml source tree by scripts/ggml-experts-bench.sh (not part of the CMake
// build: ggml is not a dependency of this project).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

namespace {

struct Options {
  int64_t experts = 896, top_k = 16, hidden = 3584, expert_hidden = 3072;
  std::vector<int> tokens = {1, 4, 16, 64, 256};
  int64_t repeat = 5, threads = 2;
};

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "ggml-experts-bench: %s\nusage: ggml-experts-bench [--experts 896] [--top-k 16] "
               "[--hidden 3584] [--expert-hidden 3072] [--tokens 1,4,16,64,256] [--repeat 5] "
               "[--threads 2]\n",
               why);
  std::exit(2);
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Usage(("missing value for " + flag).c_str());
    const char* v = argv[++i];
    char* end = nullptr;
    if (flag == "--tokens") {
      o.tokens.clear();
      for (const char* p = v; *p;) {
        const long t = std::strtol(p, &end, 10);
        if (end == p || t <= 0) Usage("bad --tokens");
        o.tokens.push_back(static_cast<int>(t));
        p = *end == ',' ? end + 1 : end;
      }
      continue;
    }
    const struct {
      const char* name;
      int64_t* value;
    } numbers[] = {{"--experts", &o.experts}, {"--top-k", &o.top_k},
                   {"--hidden", &o.hidden},   {"--expert-hidden", &o.expert_hidden},
                   {"--repeat", &o.repeat},   {"--threads", &o.threads}};
    int64_t* target = nullptr;
    for (const auto& n : numbers)
      if (flag == n.name) target = n.value;
    if (target == nullptr) Usage(("unknown flag " + flag).c_str());
    const long long n = std::strtoll(v, &end, 10);
    if (*end != '\0' || n <= 0 || n > (1 << 30)) Usage(("bad value for " + flag).c_str());
    *target = n;
  }
  if (o.top_k > o.experts) Usage("--top-k exceeds --experts");
  if (o.hidden % 32 != 0 || o.expert_hidden % 32 != 0) Usage("sizes must be multiples of 32");
  return o;
}

// Random MXFP4 blocks: 1 E8M0 scale byte (2^-7 .. 2^-3) and 16 bytes of E2M1 code pairs, ggml's
// block layout for 32 weights (checked: a ggml that changed it would get garbage otherwise).
void FillMxfp4(ggml_tensor* t, uint64_t seed) {
  const size_t block_bytes = ggml_type_size(GGML_TYPE_MXFP4);
  if (ggml_blck_size(GGML_TYPE_MXFP4) != 32 || block_bytes != 17) {
    std::fprintf(stderr, "ggml-experts-bench: this ggml's MXFP4 block is not 1 + 16 bytes\n");
    std::exit(1);
  }
  auto* p = static_cast<uint8_t*>(t->data);
  const size_t blocks = ggml_nbytes(t) / block_bytes;
  std::mt19937_64 rng(seed);
  for (size_t b = 0; b < blocks; ++b, p += block_bytes) {
    uint64_t r = rng();
    p[0] = static_cast<uint8_t>(120 + r % 5);
    const uint64_t a = rng(), c = rng();
    std::memcpy(p + 1, &a, 8);
    std::memcpy(p + 9, &c, 8);
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  ggml_cpu_init();
  const int64_t E = o.experts, K = o.hidden, H = o.expert_hidden;

  // The experts' weights, in one context: [K, H, E] gate and up, [H, K, E] down.
  const size_t weight_bytes = 3 * ggml_row_size(GGML_TYPE_MXFP4, K) * H * E;
  ggml_init_params wp = {weight_bytes + 16 * ggml_tensor_overhead(), nullptr, false};
  ggml_context* wctx = ggml_init(wp);
  if (wctx == nullptr) Usage("cannot allocate the weights");
  ggml_tensor* gate = ggml_new_tensor_3d(wctx, GGML_TYPE_MXFP4, K, H, E);
  ggml_tensor* up = ggml_new_tensor_3d(wctx, GGML_TYPE_MXFP4, K, H, E);
  ggml_tensor* down = ggml_new_tensor_3d(wctx, GGML_TYPE_MXFP4, H, K, E);
  FillMxfp4(gate, 1);
  FillMxfp4(up, 2);
  FillMxfp4(down, 3);

  std::vector<uint8_t> evict(256u << 20, 1);
  std::mt19937 rng(7);
  std::printf(
      "ggml %s, mul_mat_id MXFP4, E = %lld, top-%lld, K = %lld, H = %lld, %d threads, "
      "weights %.2f GB\n",
      ggml_version(), static_cast<long long>(E), static_cast<long long>(o.top_k),
      static_cast<long long>(K), static_cast<long long>(H), static_cast<int>(o.threads),
      weight_bytes / 1e9);
  std::printf("%7s %11s %9s %15s\n", "tokens", "median ms", "min ms", "experts touched");
  for (int T : o.tokens) {
    ggml_init_params gp = {size_t{1} << 30, nullptr, false};
    ggml_context* ctx = ggml_init(gp);
    ggml_tensor* x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, K, 1, T);
    ggml_tensor* ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, o.top_k, T);
    ggml_tensor* weights = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, o.top_k, T);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    for (int64_t i = 0; i < K * T; ++i) static_cast<float*>(x->data)[i] = uniform(rng);
    for (int64_t i = 0; i < o.top_k * T; ++i)
      static_cast<float*>(weights->data)[i] = 0.5f + 0.5f * uniform(rng);

    ggml_tensor* g = ggml_mul_mat_id(ctx, gate, x, ids);  // [H, top_k, T]
    ggml_tensor* u = ggml_mul_mat_id(ctx, up, x, ids);
    ggml_tensor* act = ggml_swiglu_split(ctx, g, u);
    ggml_tensor* y = ggml_mul_mat_id(ctx, down, act, ids);  // [K, top_k, T]
    y = ggml_mul(ctx, y, weights);
    ggml_tensor* sum = ggml_view_2d(ctx, y, K, T, y->nb[2], 0);
    for (int64_t k = 1; k < o.top_k; ++k)
      sum = ggml_add(ctx, sum, ggml_view_2d(ctx, y, K, T, y->nb[2], k * y->nb[1]));
    ggml_cgraph* graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, sum);

    std::vector<double> ms;
    std::vector<int> perm(E);
    std::vector<bool> touched(E);
    int64_t touched_count = 0;
    for (int run = 0; run <= o.repeat; ++run) {  // run 0 warms up
      auto* id = static_cast<int32_t*>(ids->data);
      std::fill(touched.begin(), touched.end(), false);
      for (int t = 0; t < T; ++t) {
        for (int64_t e = 0; e < E; ++e) perm[e] = static_cast<int>(e);
        for (int64_t k = 0; k < o.top_k; ++k) {  // a partial Fisher-Yates: distinct experts
          std::swap(perm[k], perm[k + rng() % (E - k)]);
          id[t * o.top_k + k] = perm[k];
          touched[perm[k]] = true;
        }
      }
      touched_count = std::count(touched.begin(), touched.end(), true);
      for (size_t i = 0; i < evict.size(); i += 64) evict[i] = static_cast<uint8_t>(evict[i] + 1);
      const auto t0 = std::chrono::steady_clock::now();
      if (ggml_graph_compute_with_ctx(ctx, graph, static_cast<int>(o.threads)) !=
          GGML_STATUS_SUCCESS) {
        std::fprintf(stderr, "ggml-experts-bench: graph compute failed at %d tokens\n", T);
        return 1;
      }
      const double elapsed =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (run > 0) ms.push_back(elapsed);
    }
    std::printf("%7d %11.1f %9.1f %15lld\n", T, Median(ms), *std::min_element(ms.begin(), ms.end()),
                static_cast<long long>(touched_count));
    std::fflush(stdout);
    ggml_free(ctx);
  }
  ggml_free(wctx);
  return 0;
}
