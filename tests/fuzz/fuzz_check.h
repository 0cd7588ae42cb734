// What a fuzz target asserts about a parser's answer. A failed check aborts, so the fuzzer
// (or tests/fuzz/fuzz_driver.cc) keeps the input as a crash.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"

#define FUZZ_CHECK(condition)                                                                 \
  do {                                                                                        \
    if (!(condition)) {                                                                       \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

// A rejection must carry one of the codes the parser documents, never INTERNAL or UNKNOWN.
#define FUZZ_CHECK_CODE(status, ...)                                                               \
  do {                                                                                             \
    const ::absl::StatusCode fuzz_code_ = (status).code();                                         \
    bool fuzz_expected_ = false;                                                                   \
    for (::absl::StatusCode c : {__VA_ARGS__}) fuzz_expected_ = fuzz_expected_ || c == fuzz_code_; \
    if (!fuzz_expected_) {                                                                         \
      std::fprintf(stderr, "%s:%d: unexpected status %s\n", __FILE__, __LINE__,                    \
                   (status).ToString().c_str());                                                   \
      std::abort();                                                                                \
    }                                                                                              \
  } while (0)
