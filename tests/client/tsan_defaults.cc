// ThreadSanitizer defaults for the client tests, compiled in only under -fsanitize=thread.
//
// NOTES: Debian's gRPC, Abseil and protobuf are not instrumented, so TSan cannot see their
// synchronization (absl::Mutex, completion queues): their memcpy calls, and gRPC's callback
// server (which runs the default health service), would be reported as races. Races between
// accesses in our own (instrumented) code are still reported.
#if defined(__SANITIZE_THREAD__)
#define MOE_CLIENT_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MOE_CLIENT_TEST_TSAN 1
#endif
#endif

#ifdef MOE_CLIENT_TEST_TSAN
extern "C" __attribute__((used)) const char* __tsan_default_options() {
  return "ignore_noninstrumented_modules=1";
}
extern "C" __attribute__((used)) const char* __tsan_default_suppressions() {
  return "race:libgrpc++.so\n";
}
#endif
