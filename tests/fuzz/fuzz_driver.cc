// A libFuzzer-compatible driver for compilers without libFuzzer (GCC, every build here): runs
// a target's `LLVMFuzzerTestOneInput` on every file of its seed corpus, then on a seeded,
// deterministic stream of mutations of those files, for a bounded number of runs or seconds.
// No coverage feedback: this is the sample every CI build runs (the ASan/UBSan stage too);
// the real fuzzing is the libFuzzer build (MOE_FUZZ, docs/FUZZING.md).
//
//   fuzz_<target> [-runs=N] [-max_total_time=S] [-seed=N] [-max_len=N] [-timeout=S]
//                 [-artifact_prefix=P] FILE_OR_DIR...
//
// The flags mean what libFuzzer's do (-runs counts mutated inputs). A crash, sanitizer report
// or hang leaves the input in <artifact_prefix>crash-<target>-seed<S>-run<N> and prints it;
// running the binary on that file replays it.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOE_FUZZ_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define MOE_FUZZ_ASAN 1
#endif

// One input may make a parser allocate this much at most (a few times the input is normal;
// more means a size field was trusted).
constexpr size_t kMaxAllocationBytes = size_t{256} << 20;

#ifdef MOE_FUZZ_ASAN
// Under ASan an oversized allocation is a report ("requested allocation size exceeds ...").
extern "C" const char* __asan_default_options() {
  return "max_allocation_size_mb=256:allocator_may_return_null=0";
}
extern "C" void __sanitizer_set_death_callback(void (*callback)(void));
#endif
// GCC's UBSan runtime does not run ASan's death callback; aborting reaches our SIGABRT handler.
extern "C" const char* __ubsan_default_options() { return "abort_on_error=1"; }

namespace {

// ---- the input being run, for the crash report ---------------------------------------------

std::atomic<const uint8_t*> g_current{nullptr};
std::atomic<size_t> g_current_size{0};
char g_artifact_path[4096] = {};     // where the current input goes if it crashes
std::atomic<uint64_t> g_started{0};  // inputs started, for the hang watchdog

// Async-signal-safe: open/write/close only.
void WriteCurrentInput() {
  const uint8_t* const input = g_current.load();
  const size_t size = g_current_size.load();
  if (input == nullptr || g_artifact_path[0] == '\0') return;
  const int fd = ::open(g_artifact_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, input + done, size - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  const char prefix[] = "\nfuzz driver: the failing input is in ";
  (void)!::write(2, prefix, sizeof(prefix) - 1);
  (void)!::write(2, g_artifact_path, std::strlen(g_artifact_path));
  (void)!::write(2, "\n", 1);
}

void OnFatalSignal(int sig) {
  WriteCurrentInput();
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

[[noreturn]] void DieWithInput(const char* why) {
  std::fprintf(stderr, "fuzz driver: %s\n", why);
  WriteCurrentInput();
  std::_Exit(1);
}

}  // namespace

#ifndef MOE_FUZZ_ASAN
// Without ASan the same limit is kept here (ASan replaces operator new itself).
void* operator new(size_t size) {
  if (size > kMaxAllocationBytes) {
    char why[128];
    std::snprintf(why, sizeof(why), "one allocation of %zu bytes (limit %zu)", size,
                  kMaxAllocationBytes);
    DieWithInput(why);
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t size) { return operator new(size); }
// GCC does not see that these deletes pair with the malloc-based new above.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop
#endif

namespace {

// ---- mutations -----------------------------------------------------------------------------

// SplitMix64: small, fast, and the same stream on every platform for a given seed.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t Below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(Next() % n); }

 private:
  uint64_t state_;
};

using Bytes = std::vector<uint8_t>;

// Byte values that parsers treat specially: bounds, signs, NaN codes, JSON/.npy punctuation.
constexpr uint8_t kInterestingBytes[] = {0x00, 0x01, 0x7f, 0x80, 0xfe, 0xff, 0x20,
                                         '"',  '[',  ']',  '{',  '}',  ':',  ',',
                                         '\'', '(',  ')',  '-',  '0',  '9',  'e'};
// Values for 2/4/8-byte little-endian fields (lengths, counts, offsets, shapes).
constexpr uint64_t kInterestingWords[] = {0,
                                          1,
                                          2,
                                          0x7f,
                                          0x80,
                                          0xff,
                                          0x7fff,
                                          0xffff,
                                          0x10000,
                                          0x7fffffff,
                                          0x80000000,
                                          0xffffffff,
                                          0x100000000ull,
                                          0x4000000000000000ull,
                                          0x7fffffffffffffffull,
                                          0x8000000000000000ull,
                                          0xffffffffffffffffull};
// Replacements for a run of decimal digits (sizes and offsets in JSON and .npy headers).
const char* const kInterestingNumbers[] = {"0",
                                           "-1",
                                           "1",
                                           "128",
                                           "2147483647",
                                           "2147483648",
                                           "4294967296",
                                           "9223372036854775807",
                                           "9223372036854775808",
                                           "18446744073709551615",
                                           "99999999999999999999999",
                                           "1e308",
                                           "-0",
                                           "0.5",
                                           "3037000500"};

void Mutate(Bytes* b, const std::vector<Bytes>& corpus, size_t max_len, Rng& rng) {
  const size_t pos = rng.Below(b->size() + 1);
  switch (rng.Below(11)) {
    case 0:  // flip one bit
      if (!b->empty()) (*b)[rng.Below(b->size())] ^= static_cast<uint8_t>(1u << rng.Below(8));
      break;
    case 1:  // an interesting byte
      if (!b->empty())
        (*b)[rng.Below(b->size())] = kInterestingBytes[rng.Below(std::size(kInterestingBytes))];
      break;
    case 2:  // a random byte
      if (!b->empty()) (*b)[rng.Below(b->size())] = static_cast<uint8_t>(rng.Next());
      break;
    case 3:  // truncate
      b->resize(pos);
      break;
    case 4: {  // erase a chunk
      const size_t n = std::min(b->size() - std::min(pos, b->size()), 1 + rng.Below(16));
      b->erase(b->begin() + pos, b->begin() + pos + n);
      break;
    }
    case 5: {  // duplicate a chunk somewhere
      if (b->empty()) break;
      const size_t from = rng.Below(b->size());
      const size_t n = std::min(b->size() - from, 1 + rng.Below(64));
      const Bytes chunk(b->begin() + from, b->begin() + from + n);
      b->insert(b->begin() + pos, chunk.begin(), chunk.end());
      break;
    }
    case 6: {  // splice: this input's prefix, another's suffix
      const Bytes& other = corpus[rng.Below(corpus.size())];
      const size_t from = rng.Below(other.size() + 1);
      b->resize(pos);
      b->insert(b->end(), other.begin() + from, other.end());
      break;
    }
    case 7: {  // an interesting 2/4/8-byte little-endian field
      const size_t width = size_t{2} << rng.Below(3);
      if (b->size() < width) break;
      uint64_t v = kInterestingWords[rng.Below(std::size(kInterestingWords))];
      if (rng.Below(4) == 0) v = rng.Next() >> rng.Below(64);  // a random magnitude
      const size_t at = rng.Below(b->size() - width + 1);
      for (size_t i = 0; i < width; ++i) (*b)[at + i] = static_cast<uint8_t>(v >> (8 * i));
      break;
    }
    case 8: {  // replace a run of digits with an interesting number
      if (b->empty()) break;
      size_t start = rng.Below(b->size());
      while (start < b->size() && !std::isdigit((*b)[start])) ++start;
      if (start == b->size()) break;
      size_t end = start;
      while (end < b->size() && std::isdigit((*b)[end])) ++end;
      const char* number = kInterestingNumbers[rng.Below(std::size(kInterestingNumbers))];
      b->erase(b->begin() + start, b->begin() + end);
      b->insert(b->begin() + start, number, number + std::strlen(number));
      break;
    }
    case 9: {  // insert a few random bytes
      Bytes extra(1 + rng.Below(8));
      for (uint8_t& x : extra) x = static_cast<uint8_t>(rng.Next());
      b->insert(b->begin() + pos, extra.begin(), extra.end());
      break;
    }
    case 10: {  // repeat one byte many times (deep nesting, long strings, long numbers)
      if (b->empty()) break;
      const uint8_t x = (*b)[rng.Below(b->size())];
      b->insert(b->begin() + pos, 1 + rng.Below(256), x);
      break;
    }
  }
  if (b->size() > max_len) b->resize(max_len);
}

// ---- running -------------------------------------------------------------------------------

bool ReadFile(const std::filesystem::path& path, Bytes* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return !in.bad();
}

// `artifact`: where the input goes if it crashes ("" for none).
void RunOne(const Bytes& input, const std::string& artifact) {
  std::snprintf(g_artifact_path, sizeof(g_artifact_path), "%s", artifact.c_str());
  g_current_size = input.size();
  g_current = input.data();
  g_started.fetch_add(1, std::memory_order_relaxed);
  // A copy of exactly the input's size, so that ASan sees any read past its end.
  std::unique_ptr<uint8_t[]> exact(new uint8_t[input.size()]);
  if (!input.empty()) std::memcpy(exact.get(), input.data(), input.size());
  LLVMFuzzerTestOneInput(exact.get(), input.size());
  g_current = nullptr;
}

bool Flag(const char* arg, const char* name, uint64_t* value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  *value = std::strtoull(arg + n + 1, nullptr, 10);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t runs = 10000, max_total_time = 0, seed = 1, max_len = 1 << 20, timeout = 20;
  std::string artifact_prefix;
  std::vector<std::filesystem::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (Flag(a, "-runs", &runs) || Flag(a, "-max_total_time", &max_total_time) ||
        Flag(a, "-seed", &seed) || Flag(a, "-max_len", &max_len) || Flag(a, "-timeout", &timeout))
      continue;
    if (std::strncmp(a, "-artifact_prefix=", 17) == 0) {
      artifact_prefix = a + 17;
      continue;
    }
    if (a[0] == '-') {
      std::fprintf(stderr, "unknown flag %s (see tests/fuzz/fuzz_driver.cc)\n", a);
      return 2;
    }
    inputs.emplace_back(a);
  }
  const std::string target = std::filesystem::path(argv[0]).filename().string();

#ifdef MOE_FUZZ_ASAN
  // ASan reports faults itself (and then calls the death callback); abort() is ours.
  __sanitizer_set_death_callback(WriteCurrentInput);
  ::signal(SIGABRT, OnFatalSignal);
#else
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) ::signal(sig, OnFatalSignal);
#endif

  // Files in a directory run in name order, so a run is the same on every machine.
  std::vector<std::filesystem::path> files;
  for (const auto& p : inputs) {
    if (std::filesystem::is_directory(p)) {
      std::vector<std::filesystem::path> in_dir;
      for (const auto& e : std::filesystem::directory_iterator(p))
        if (e.is_regular_file()) in_dir.push_back(e.path());
      std::sort(in_dir.begin(), in_dir.end());
      files.insert(files.end(), in_dir.begin(), in_dir.end());
    } else {
      files.push_back(p);
    }
  }
  std::vector<Bytes> corpus;
  for (const auto& f : files) {
    Bytes b;
    if (!ReadFile(f, &b)) {
      std::fprintf(stderr, "%s: cannot read %s\n", target.c_str(), f.c_str());
      return 2;
    }
    corpus.push_back(std::move(b));
  }

  // A hang is an input that runs longer than -timeout seconds.
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    uint64_t last = g_started.load();
    auto since = std::chrono::steady_clock::now();
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const uint64_t now = g_started.load();
      if (now != last) {
        last = now;
        since = std::chrono::steady_clock::now();
      } else if (g_current != nullptr &&
                 std::chrono::steady_clock::now() - since > std::chrono::seconds(timeout)) {
        DieWithInput("an input ran longer than -timeout");
      }
    }
  });

  const auto start = std::chrono::steady_clock::now();
  // A file that fails is its own reproducer: only its name is printed.
  for (size_t i = 0; i < corpus.size(); ++i) {
    std::fprintf(stderr, "%s: running %s\n", target.c_str(), files[i].c_str());
    RunOne(corpus[i], "");
  }
  if (corpus.empty()) corpus.push_back({});

  Rng rng(seed);
  uint64_t mutated = 0;
  Bytes input;
  for (; mutated < runs; ++mutated) {
    if (max_total_time > 0 &&
        std::chrono::steady_clock::now() - start > std::chrono::seconds(max_total_time))
      break;
    input = corpus[rng.Below(corpus.size())];
    for (size_t m = 1 + rng.Below(4) + (rng.Below(8) == 0 ? 8 : 0); m > 0; --m)
      Mutate(&input, corpus, max_len, rng);
    RunOne(input, artifact_prefix + "crash-" + target + "-seed" + std::to_string(seed) + "-run" +
                      std::to_string(mutated));
  }
  done = true;
  watchdog.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s: %zu corpus files and %llu mutated inputs (seed %llu) in %.2f s: %.0f execs/s\n",
              target.c_str(), files.size(), static_cast<unsigned long long>(mutated),
              static_cast<unsigned long long>(seed), seconds,
              static_cast<double>(files.size() + mutated) / std::max(seconds, 1e-9));
  return 0;
}
