// ThreadSanitizer defaults for the client tests, compiled in only under -fsanitize=thread.
//
// NOTES: Debian's gRPC, Abseil and protobuf are not instrumented, so TSan cannot see their
// synchronization (absl::Mutex, completion queues): their memcpy calls would be reported as
// races (ignore_noninstrumented_modules), and so would gRPC internals (tsan.supp). Races
// between accesses in our own, instrumented code are still reported.
#if defined(__SANITIZE_THREAD__)
#define MOE_CLIENT_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MOE_CLIENT_TEST_TSAN 1
#endif
#endif

#ifdef MOE_CLIENT_TEST_TSAN
extern "C" __attribute__((used)) const char* __tsan_default_options() {
  return "ignore_noninstrumented_modules=1 suppressions=" MOE_SOURCE_DIR "/tests/client/tsan.supp";
}
#endif
