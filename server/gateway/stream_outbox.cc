#include "server/gateway/stream_outbox.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/memory.h"

namespace moe {

bool StreamBufferBudget::TryTake(int64_t bytes) {
  int64_t held = held_.load();
  do {
    if (held + bytes > limit_) return false;
  } while (!held_.compare_exchange_weak(held, held + bytes));
  Observe();
  return true;
}

void StreamBufferBudget::Adjust(int64_t bytes) {
  held_ += bytes;
  if (bytes != 0) Observe();
}

void StreamBufferBudget::Observe() {
  if (!observer_) return;
  // Read under the lock: the last caller reports the total after every change so far.
  std::lock_guard<std::mutex> lock(observer_mu_);
  observer_(held_.load());
}

StreamOutbox::StreamOutbox(Stream* stream, int64_t max_bytes, StreamBufferBudget* budget)
    : stream_(stream), max_bytes_(max_bytes), budget_(budget), writer_([this] { WriteLoop(); }) {}

StreamOutbox::~StreamOutbox() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  cv_.notify_all();
  writer_.join();
  std::lock_guard<std::mutex> lock(mu_);
  Held(-(queued_bytes_ + reserved_bytes_));
  // glibc keeps freed heap for reuse; after tens of MB of responses that is memory a burst of
  // slow readers would otherwise pin for good.
  if (peak_bytes_ >= kReturnFreedMemoryAfterBytes) ReturnFreedMemory();
}

void StreamOutbox::Held(int64_t delta) {
  budget_->Adjust(delta);
  peak_bytes_ = std::max(peak_bytes_, queued_bytes_ + reserved_bytes_);
}

absl::Status StreamOutbox::Admit(int64_t response_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t held = queued_bytes_ + reserved_bytes_;
  if (held != 0 && held + response_bytes > max_bytes_)
    return absl::ResourceExhaustedError(absl::StrFormat(
        "this stream's reader is behind: %d responses (%.1f MiB) wait to be read and %.1f MiB "
        "are being computed, against the %.1f MiB the gateway buffers per stream "
        "(--stream-buffer-mb); read them or open another stream",
        queue_.size(), queued_bytes_ / 1048576.0, reserved_bytes_ / 1048576.0,
        max_bytes_ / 1048576.0));
  if (!budget_->TryTake(response_bytes))
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the gateway's buffers for slow stream readers are full: %.1f MiB held by all streams "
        "against %.1f MiB (--stream-buffer-total-mb); read the responses or retry later",
        budget_->held() / 1048576.0, budget_->limit() / 1048576.0));
  reserved_bytes_ += response_bytes;
  Held(0);
  return absl::OkStatus();
}

void StreamOutbox::Push(moe::v1::ForwardResponse response, int64_t reserved) {
  std::lock_guard<std::mutex> lock(mu_);
  reserved_bytes_ -= reserved;
  if (broken_) {
    Held(-reserved);
    return;
  }
  const int64_t bytes = static_cast<int64_t>(response.ByteSizeLong());
  queued_bytes_ += bytes;
  Held(bytes - reserved);
  queue_.push_back(std::move(response));
  cv_.notify_all();
}

void StreamOutbox::WaitBelow(size_t max_messages) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return broken_ || queue_.size() < max_messages; });
}

void StreamOutbox::WriteLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return !queue_.empty() || closing_; });
    if (queue_.empty()) return;  // closing, all written
    // The front stays queued (and counted) while it is written: it has not been read yet.
    const moe::v1::ForwardResponse& front = queue_.front();
    lock.unlock();
    const bool ok = stream_->Write(front);
    lock.lock();
    const int64_t written = static_cast<int64_t>(queue_.front().ByteSizeLong());
    queued_bytes_ -= written;
    Held(-written);
    queue_.pop_front();
    if (!ok) {
      broken_ = true;
      queue_.clear();
      Held(-queued_bytes_);
      queued_bytes_ = 0;
    }
    cv_.notify_all();
  }
}

}  // namespace moe
