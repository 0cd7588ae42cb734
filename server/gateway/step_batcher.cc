#include "server/gateway/step_batcher.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moe {

StepBatcher::StepBatcher(StepEngine* engine, const BatcherOptions& options)
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
      if (!call->finished) Complete(*call, absl::UnavailableError("the gateway is shutting down"));
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
  QueueChanged();
  q.cv.notify_one();
  return absl::OkStatus();
}

void StepBatcher::Run(int layer, LayerQueue* q) {
  std::vector<std::pair<std::shared_ptr<ForwardCall>, absl::Status>> dead;
  for (;;) {
    std::vector<Piece> pieces;
    dead.clear();
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
      pieces = TakeStep(q, &dead);
    }
    QueueChanged();
    for (auto& [call, status] : dead) Complete(*call, status);
    if (!pieces.empty()) RunStep(layer, pieces);
  }
}

std::vector<StepBatcher::Piece> StepBatcher::TakeStep(
    LayerQueue* q, std::vector<std::pair<std::shared_ptr<ForwardCall>, absl::Status>>* dead) {
  const absl::Time now = absl::Now();
  std::vector<Piece> pieces;
  int64_t room = options_.max_tokens_per_step;
  while (room > 0 && !q->calls.empty()) {
    std::shared_ptr<ForwardCall> call = std::move(q->calls.front());
    q->calls.pop_front();
    const int64_t left = call->tokens - call->rows_started;
    absl::Status gone;
    if (call->cancelled) {
      gone = absl::CancelledError("the client cancelled the request");
    } else if (call->deadline <= now) {
      gone = absl::DeadlineExceededError(call->rows_started == 0
                                             ? "deadline passed while queued"
                                             : "deadline passed between the request's steps");
    }
    if (call->finished || !gone.ok()) {  // nothing of it runs any more
      q->tokens -= left;
      queued_tokens_ -= left;
      if (!call->finished) {
        call->finished = true;
        dead->emplace_back(std::move(call), std::move(gone));
      }
      continue;
    }
    const int64_t rows = std::min(left, room);
    pieces.push_back(Piece{call, call->rows_started, rows});
    call->rows_started += rows;
    room -= rows;
    q->tokens -= rows;
    queued_tokens_ -= rows;
    if (call->rows_started < call->tokens) q->calls.push_back(std::move(call));  // the step is full
  }
  return pieces;
}

void StepBatcher::RunStep(int layer, std::vector<Piece>& pieces) {
  const absl::Time now = absl::Now();
  const int64_t H = engine_->config().hidden_size;
  int64_t tokens = 0;
  absl::Time deadline = absl::InfinitePast();
  for (const Piece& p : pieces) {
    tokens += p.rows;
    deadline = std::max(deadline, p.call->deadline);
  }
  deadline = std::min(deadline, now + options_.step_timeout);
  // The step's rows, gathered from its callers' (the one copy batching needs).
  ActivationRows x(engine_->precision(), tokens, H), out;
  int64_t offset = 0;
  for (const Piece& p : pieces) {
    x.CopyRows(offset, p.call->input, p.begin, p.rows);
    offset += p.rows;
  }
  Routing routing;
  // A token that chose an expert whose every replica is down fails its own call only.
  UnservedTokens unserved;
  for (const Piece& p : pieces)
    unserved.segment_ends.push_back(
        (unserved.segment_ends.empty() ? 0 : unserved.segment_ends.back()) + p.rows);
  const absl::Status step_status =
      engine_->RunStep(layer, x, deadline, &out, &routing, nullptr, &unserved);
  const absl::Time end = absl::Now();
  offset = 0;
  size_t next_unserved = 0;
  for (Piece& p : pieces) {
    ForwardCall& call = *p.call;
    absl::Status status = step_status;
    while (next_unserved < unserved.tokens.size() && unserved.tokens[next_unserved] < offset)
      ++next_unserved;
    if (status.ok() && next_unserved < unserved.tokens.size() &&
        unserved.tokens[next_unserved] < offset + p.rows)
      status = unserved.status;
    if (p.begin == 0) {
      call.first_step = now;
      call.queue_time = now - call.enqueued;
      call.output = ActivationRows(x.precision(), call.tokens, H);
    }
    call.step_time = end - call.first_step;
    call.step_tokens = std::max(call.step_tokens, tokens);
    ++call.steps;
    if (status.ok()) {
      call.output.CopyRows(p.begin, out, offset, p.rows);
      if (call.want_routing) {
        const int k = routing.top_k;
        if (p.begin == 0) {
          call.routing.tokens = call.tokens;
          call.routing.top_k = k;
          call.routing.ids.resize(call.tokens * k);
          call.routing.weights.resize(call.tokens * k);
        }
        std::copy(routing.ids.begin() + offset * k, routing.ids.begin() + (offset + p.rows) * k,
                  call.routing.ids.begin() + p.begin * k);
        std::copy(routing.weights.begin() + offset * k,
                  routing.weights.begin() + (offset + p.rows) * k,
                  call.routing.weights.begin() + p.begin * k);
      }
    }
    offset += p.rows;
    const bool last = p.begin + p.rows == call.tokens;
    if (!status.ok() || last) {
      call.finished = true;  // rows still queued after an error are dropped by TakeStep
      if (!status.ok()) call.output = ActivationRows();
      Complete(call, status);
    }
  }
}

}  // namespace moe
