#include "server/gateway/stream_outbox.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moe {

StreamOutbox::StreamOutbox(Stream* stream, int64_t max_bytes)
    : stream_(stream), max_bytes_(max_bytes), writer_([this] { WriteLoop(); }) {}

StreamOutbox::~StreamOutbox() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  cv_.notify_all();
  writer_.join();
}

absl::Status StreamOutbox::Admit(int64_t response_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t held = queued_bytes_ + reserved_bytes_;
  if (held == 0 || held + response_bytes <= max_bytes_) {
    reserved_bytes_ += response_bytes;
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrFormat(
      "this stream's reader is behind: %d responses (%.1f MiB) wait to be read and %.1f MiB "
      "are being computed, against the %.1f MiB the gateway buffers per stream "
      "(--stream-buffer-mb); read them or open another stream",
      queue_.size(), queued_bytes_ / 1048576.0, reserved_bytes_ / 1048576.0,
      max_bytes_ / 1048576.0));
}

void StreamOutbox::Push(moe::v1::ForwardResponse response, int64_t reserved) {
  std::lock_guard<std::mutex> lock(mu_);
  reserved_bytes_ -= reserved;
  if (broken_) return;
  queued_bytes_ += static_cast<int64_t>(response.ByteSizeLong());
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
    queued_bytes_ -= static_cast<int64_t>(queue_.front().ByteSizeLong());
    queue_.pop_front();
    if (!ok) {
      broken_ = true;
      queue_.clear();
      queued_bytes_ = 0;
    }
    cv_.notify_all();
  }
}

}  // namespace moe
