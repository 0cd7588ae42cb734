// The responses of one ForwardStream on their way to the client, written by a thread of the
// stream's own.
//
// NOTES: a stream Write blocks while the client does not read (HTTP/2 flow control). Written on
// the batcher thread, as completions once were, one client that stopped reading stalled every
// caller of its layer. Here a completion only queues its response (never blocks); the queue's
// bytes, with those of the requests still running, are bounded by refusing the stream's new
// requests beyond `max_bytes` (RESOURCE_EXHAUSTED, see Admit): a slow reader costs only its
// own requests. All streams together are bounded as well (StreamBufferBudget), so many slow
// readers cannot add up to more than the gateway's total either.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "moe/v1/moe.grpc.pb.h"

namespace moe {

// The bytes every StreamOutbox of a gateway together holds (queued and reserved), against one
// limit (--stream-buffer-total-mb). Thread-safe.
class StreamBufferBudget {
 public:
  explicit StreamBufferBudget(int64_t limit = int64_t{256} << 20) : limit_(limit) {}
  int64_t limit() const { return limit_; }
  // Called with the total after every change (a gauge). Set before any stream.
  void SetObserver(std::function<void(int64_t bytes)> observer) { observer_ = std::move(observer); }
  int64_t held() const { return held_.load(); }
  // Takes `bytes` if the total stays within the limit.
  bool TryTake(int64_t bytes);
  // Takes (or, negative, gives back) `bytes` unconditionally: small error responses, and the
  // difference between a reservation and the response that fills it.
  void Adjust(int64_t bytes);

 private:
  void Observe();

  const int64_t limit_;
  std::atomic<int64_t> held_{0};
  std::function<void(int64_t)> observer_;
  std::mutex observer_mu_;
};

class StreamOutbox {
 public:
  using Stream = grpc::ServerReaderWriter<moe::v1::ForwardResponse, moe::v1::ForwardRequest>;

  // `budget` (the gateway's, outliving the outbox) bounds all streams together.
  StreamOutbox(Stream* stream, int64_t max_bytes, StreamBufferBudget* budget);
  // Writes what is queued unless the stream broke, then stops the writer; the bytes go back to
  // the budget, and a stream that buffered much hands its freed memory back to the system.
  ~StreamOutbox();
  StreamOutbox(const StreamOutbox&) = delete;
  StreamOutbox& operator=(const StreamOutbox&) = delete;

  // Whether a new request whose response will take about `response_bytes` may run: its bytes
  // are reserved, and refused (RESOURCE_EXHAUSTED) when the responses queued plus those
  // reserved would pass `max_bytes` (one request is always admitted into an empty outbox), or
  // all streams' would pass the budget's limit.
  absl::Status Admit(int64_t response_bytes);
  // Queues a response and releases the `reserved` bytes its request was admitted with; never
  // blocks. Dropped once the stream broke.
  void Push(moe::v1::ForwardResponse response, int64_t reserved = 0);
  // Blocks while more than `max_messages` responses are queued (a client that keeps sending
  // but never reads: even its small error responses must not pile up without bound).
  void WaitBelow(size_t max_messages);

 private:
  void WriteLoop();

  // The budget follows queued_bytes_ + reserved_bytes_ (mu_ held).
  void Held(int64_t delta);

  Stream* const stream_;
  const int64_t max_bytes_;
  StreamBufferBudget* const budget_;
  int64_t peak_bytes_ = 0;  // guarded by mu_
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<moe::v1::ForwardResponse> queue_;  // guarded by mu_
  int64_t queued_bytes_ = 0;                    // guarded by mu_
  int64_t reserved_bytes_ = 0;                  // guarded by mu_: admitted, still running
  bool broken_ = false;                         // guarded by mu_: a Write failed
  bool closing_ = false;                        // guarded by mu_
  std::thread writer_;
};

}  // namespace moe
