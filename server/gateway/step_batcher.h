// Batches concurrent requests for the same layer into steps of at most `max_tokens_per_step`.
//
// One scheduler thread per served layer: it waits for the first request, then up to `max_wait`
// for more (0 by default: requests that arrive while a step runs are batched into the next step
// without any wait, as Triton's dynamic batcher does; an idle layer starts at once), fills a
// step from the queue in order and hands every caller its own rows back. A request that does not fit the
// step's room is split: its first rows run now, the rest goes to the back of the queue, so a
// small request never waits behind much more than one step of a large one's tokens (head-of-
// line blocking). Splitting changes no bit: the kernels are batch invariant. Cancelled or
// expired requests are answered before each of their pieces, without running.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/activations.h"
#include "engine/step_engine.h"
#include "model/dispatch.h"

namespace moe {

struct BatcherOptions {
  // Tokens in one step (larger requests are split). A small call waits behind at most about one
  // step of a large one: on k3-mini, 2 ranks, 2 cores, a 1-token call behind back-to-back
  // 4096-token requests waited 179 ms (p90) with 4096, 126 ms with 1024, 69 ms with 512, for
  // 3% and 10% more time on the 4096-token request. Steps too small to amortize the expert
  // weights cost more on memory-bound GPUs: raise it there (docs/CLI.md, moe-gateway).
  int64_t max_tokens_per_step = 1024;
  absl::Duration max_wait = absl::ZeroDuration();  // how long an idle layer waits to fill a step
  absl::Duration step_timeout = absl::Seconds(60);    // bound on a step's exchange with the ranks
  int64_t max_queued_tokens = 1 << 20;  // beyond this, new requests get RESOURCE_EXHAUSTED
};

// A one-shot completion flag. NOTES: std primitives, not absl::Notification: Debian's Abseil is
// not built for ThreadSanitizer, which then reports false races through it.
class Completion {
 public:
  void Notify() {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }
  // True once notified; false when `timeout` passed first.
  bool WaitFor(absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [this] { return done_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

// One caller's request and, when `done` fires, its result.
struct ForwardCall {
  int layer = 0;
  int64_t tokens = 0;
  ActivationRows input;  // [tokens, H] in the engine's precision
  absl::Time deadline = absl::InfiniteFuture();
  bool want_routing = false;
  std::atomic<bool> cancelled{false};  // set by the service when the client goes away
  // Invoked on the scheduler thread after the result fields are set (e.g. stream writes).
  std::function<void(ForwardCall&)> on_done;

  // Result.
  absl::Status status;
  ActivationRows output;                 // [tokens, H] in the engine's precision
  Routing routing;                       // this call's rows only
  absl::Duration queue_time, step_time;  // until its first step; from then to the end
  int64_t step_tokens = 0;               // the largest step it was part of
  int steps = 0;                         // steps its rows were split over
  Completion done;

  // The scheduler's own (layer thread only).
  absl::Time enqueued, first_step;
  int64_t rows_started = 0;  // rows handed to steps so far
  bool finished = false;     // completed (an error may end it with rows still queued)
};

class StepBatcher {
 public:
  StepBatcher(StepEngine* engine, const BatcherOptions& options);
  ~StepBatcher();  // answers queued calls with UNAVAILABLE and joins the threads

  // Queues a call (its layer must be served). Fails fast with RESOURCE_EXHAUSTED when the
  // queue is over its limit; otherwise the call completes through `done`.
  absl::Status Submit(std::shared_ptr<ForwardCall> call);
  int64_t queued_tokens() const { return queued_tokens_.load(); }
  // Called with the queued token count whenever it changes (a gauge). Set before traffic.
  void SetQueueObserver(std::function<void(int64_t tokens)> observer) {
    queue_observer_ = std::move(observer);
  }

 private:
  struct LayerQueue {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::shared_ptr<ForwardCall>> calls;
    int64_t tokens = 0;
    std::thread thread;
  };
  // Rows [begin, begin + rows) of a call, in one step.
  struct Piece {
    std::shared_ptr<ForwardCall> call;
    int64_t begin = 0, rows = 0;
  };
  void Run(int layer, LayerQueue* queue);
  // Takes the next step's pieces off the queue (q->mu held); calls that died while queued go
  // to `dead` with their status, to be completed outside the lock.
  std::vector<Piece> TakeStep(
      LayerQueue* q, std::vector<std::pair<std::shared_ptr<ForwardCall>, absl::Status>>* dead);
  void RunStep(int layer, std::vector<Piece>& pieces);
  static void Complete(ForwardCall& call, absl::Status status);

  StepEngine* engine_;
  BatcherOptions options_;
  std::map<int, std::unique_ptr<LayerQueue>> queues_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> queued_tokens_{0};
  std::function<void(int64_t)> queue_observer_;
  void QueueChanged() {
    if (queue_observer_) queue_observer_(queued_tokens_.load());
  }
};

}  // namespace moe
