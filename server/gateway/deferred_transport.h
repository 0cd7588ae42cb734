// A GatewayTransport that becomes usable later: the NCCL communicator only exists once every
// rank has joined, but the engine is built at start-up. Until Install, steps fail UNAVAILABLE.
#pragma once

#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "transport/transport.h"

namespace moe {

class DeferredTransport final : public GatewayTransport {
 public:
  explicit DeferredTransport(std::string name) : name_(std::move(name)) {}
  void Install(std::unique_ptr<GatewayTransport> transport) {
    std::lock_guard<std::mutex> lock(mu_);
    transport_ = std::move(transport);
  }
  bool installed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return transport_ != nullptr;
  }
  std::string name() const override { return name_; }
  absl::Status Send(const StepDispatch& dispatch) override {
    GatewayTransport* t = Get();
    if (t == nullptr)
      return absl::UnavailableError(absl::StrCat(name_, " transport is not connected yet"));
    return t->Send(dispatch);
  }
  absl::Status Collect(const StepDispatch& dispatch, absl::Time deadline,
                       const std::function<absl::Status(size_t, ConstPartialView,
                                                        const RankStepStats&)>& consume) override {
    GatewayTransport* t = Get();
    if (t == nullptr)
      return absl::UnavailableError(absl::StrCat(name_, " transport is not connected yet"));
    return t->Collect(dispatch, deadline, consume);
  }
  void Abandon(uint64_t step_id) override {
    if (GatewayTransport* t = Get()) t->Abandon(step_id);
  }
  void RankDown(int rank, absl::string_view why) override {
    if (GatewayTransport* t = Get()) t->RankDown(rank, why);
  }
  void RankUp(int rank) override {
    if (GatewayTransport* t = Get()) t->RankUp(rank);
  }

 private:
  GatewayTransport* Get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return transport_.get();
  }
  std::string name_;
  mutable std::mutex mu_;
  std::unique_ptr<GatewayTransport> transport_;
};

}  // namespace moe
