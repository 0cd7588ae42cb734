#include "server/gateway/step_batcher.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {

StepBatcher::StepBatcher(GatewayEngine* engine, const BatcherOptions& options)
    : engine_(engine), options_(options) {
  for (int layer : engine_->layers()) {
    auto queue = std::make_unique<LayerQueue>();
    LayerQueue* q = queue.get();
    queues_[layer] = std::move(queue);
    q->thread = std::thread([this, layer, q] { Run(layer, q); });
  }
}

StepBatcher::~StepBatcher() {
  stop_ = true;
  for (auto& [layer, q] : queues_) {
    {
      std::lock_guard<std::mutex> lock(q->mu);
      q->cv.notify_all();
    }
    q->thread.join();
    for (auto& call : q->calls)
      Complete(*call, absl::UnavailableError("the gateway is shutting down"));
  }
}

void StepBatcher::Complete(ForwardCall& call, absl::Status status) {
  call.status = std::move(status);
  if (call.on_done) call.on_done(call);
  call.done.Notify();
}

absl::Status StepBatcher::Submit(std::shared_ptr<ForwardCall> call) {
  auto it = queues_.find(call->layer);
  if (it == queues_.end())
    return absl::NotFoundError(absl::StrCat("layer ", call->layer, " is not served"));
  if (queued_tokens_.load() + call->tokens > options_.max_queued_tokens)
    return absl::ResourceExhaustedError(absl::StrCat(
        "gateway queue is full (", queued_tokens_.load(), " tokens waiting); retry later"));
  LayerQueue& q = *it->second;
  call->enqueued = absl::Now();
  {
    std::lock_guard<std::mutex> lock(q.mu);
    if (stop_) return absl::UnavailableError("the gateway is shutting down");
    q.tokens += call->tokens;
    queued_tokens_ += call->tokens;
    q.calls.push_back(std::move(call));
  }
  q.cv.notify_one();
  return absl::OkStatus();
}

void StepBatcher::Run(int layer, LayerQueue* q) {
  std::vector<std::shared_ptr<ForwardCall>> batch;
  for (;;) {
    batch.clear();
    {
      std::unique_lock<std::mutex> lock(q->mu);
      q->cv.wait(lock, [&] { return stop_ || !q->calls.empty(); });
      if (stop_) return;
      // Give concurrent callers `max_wait` to join, unless the step is already full.
      const absl::Time fill_until = q->calls.front()->enqueued + options_.max_wait;
      while (!stop_ && q->tokens < options_.max_tokens_per_step && absl::Now() < fill_until) {
        q->cv.wait_for(lock, absl::ToChronoNanoseconds(fill_until - absl::Now()));
      }
      if (stop_) return;
      int64_t tokens = 0;
      while (!q->calls.empty()) {
        const auto& next = q->calls.front();
        if (!batch.empty() && tokens + next->tokens > options_.max_tokens_per_step) break;
        tokens += next->tokens;
        q->tokens -= next->tokens;
        queued_tokens_ -= next->tokens;
        batch.push_back(std::move(q->calls.front()));
        q->calls.pop_front();
      }
    }
    RunBatch(layer, batch);
  }
}

void StepBatcher::RunBatch(int layer, std::vector<std::shared_ptr<ForwardCall>>& batch) {
  const absl::Time now = absl::Now();
  // Drop calls nobody waits for any more.
  std::vector<std::shared_ptr<ForwardCall>> live;
  for (auto& call : batch) {
    call->queue_time = now - call->enqueued;
    if (call->cancelled) {
      Complete(*call, absl::CancelledError("the client cancelled the request"));
    } else if (call->deadline <= now) {
      Complete(*call, absl::DeadlineExceededError("deadline passed while queued"));
    } else {
      live.push_back(std::move(call));
    }
  }
  if (live.empty()) return;
  const int64_t H = engine_->config().hidden_size;
  int64_t tokens = 0;
  absl::Time deadline = absl::InfinitePast();
  for (const auto& call : live) {
    tokens += call->tokens;
    deadline = std::max(deadline, call->deadline);
  }
  deadline = std::min(deadline, now + options_.step_timeout);
  std::vector<float> x(tokens * H), out(tokens * H);
  int64_t offset = 0;
  for (const auto& call : live) {
    std::memcpy(x.data() + offset * H, call->input.data(), call->tokens * H * sizeof(float));
    offset += call->tokens;
  }
  Routing routing;
  const absl::Status status =
      engine_->RunStep(layer, x.data(), tokens, deadline, out.data(), &routing);
  const absl::Duration step_time = absl::Now() - now;
  offset = 0;
  for (const auto& call : live) {
    call->step_time = step_time;
    call->step_tokens = tokens;
    if (status.ok()) {
      call->output.assign(out.begin() + offset * H, out.begin() + (offset + call->tokens) * H);
      if (call->want_routing) {
        const int k = routing.top_k;
        call->routing.tokens = call->tokens;
        call->routing.top_k = k;
        call->routing.ids.assign(routing.ids.begin() + offset * k,
                                 routing.ids.begin() + (offset + call->tokens) * k);
        call->routing.weights.assign(routing.weights.begin() + offset * k,
                                     routing.weights.begin() + (offset + call->tokens) * k);
      }
    }
    offset += call->tokens;
    Complete(*call, status);
  }
}

}  // namespace moe
