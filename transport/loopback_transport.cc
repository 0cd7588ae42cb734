#include "transport/loopback_transport.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status.h"

namespace moe {

void LoopbackTransport::AddShard(int rank, std::unique_ptr<ExpertShard> shard) {
  ExpertShard* raw = shard.get();
  const int layer = shard->layer();
  AddRank(layer, rank, [raw](const RankPart& part, Precision precision, PartialView partial) {
    return raw->Compute(part.rows, *part.assignments, precision, partial);
  });
  layers_[layer]->owned.push_back(std::move(shard));
}

void LoopbackTransport::AddRank(int layer, int rank, RankCompute compute) {
  auto& entry = layers_[layer];
  if (entry == nullptr) {
    entry = std::make_unique<LayerRanks>();
    entry->workspace = std::make_unique<Workspace>(backend_);
  }
  entry->ranks[rank] = std::move(compute);
}

absl::Status LoopbackTransport::Send(const StepDispatch& dispatch) {
  RETURN_IF_ERROR(CheckRowStorage(dispatch));
  auto it = layers_.find(dispatch.layer);
  for (const RankPart& part : dispatch.parts)
    if (it == layers_.end() || it->second->ranks.count(part.rank) == 0)
      return absl::UnavailableError(
          absl::StrCat("rank ", part.rank, " hosts no experts of layer ", dispatch.layer));
  std::lock_guard<std::mutex> lock(mu_);
  RETURN_IF_ERROR(DownLocked(dispatch));
  if (!sent_.insert(dispatch.step_id).second)
    return absl::InvalidArgumentError(absl::StrCat("step ", dispatch.step_id, " sent twice"));
  return absl::OkStatus();
}

absl::Status LoopbackTransport::DownLocked(const StepDispatch& dispatch) const {
  for (const RankPart& part : dispatch.parts)
    if (auto it = down_.find(part.rank); it != down_.end())
      return absl::UnavailableError(
          absl::StrCat("rank ", part.rank, " ", it->second, " during step ", dispatch.step_id));
  return absl::OkStatus();
}

void LoopbackTransport::RankDown(int rank, absl::string_view why) {
  std::lock_guard<std::mutex> lock(mu_);
  down_[rank] = why.empty() ? "went down" : std::string(why);
}

void LoopbackTransport::RankUp(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  down_.erase(rank);
}

absl::Status LoopbackTransport::Collect(
    const StepDispatch& dispatch, absl::Time deadline,
    const std::function<absl::Status(size_t, ConstPartialView, const RankStepStats&)>& consume) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sent_.erase(dispatch.step_id) != 1)
      return absl::FailedPreconditionError(
          absl::StrCat("step ", dispatch.step_id, " was not sent"));
    RETURN_IF_ERROR(DownLocked(dispatch));
  }
  LayerRanks& layer = *layers_.at(dispatch.layer);
  std::lock_guard<std::mutex> lock(layer.mu);
  for (size_t i = 0; i < dispatch.parts.size(); ++i) {
    const RankPart& part = dispatch.parts[i];
    const absl::Time t0 = absl::Now();
    auto partial = layer.workspace->Partial(0, part.rows.rows, part.rows.cols);
    absl::Status s = partial.status();
    if (s.ok()) s = layer.ranks.at(part.rank)(part, dispatch.precision, *partial);
    if (!s.ok()) return RankFailure(part.rank, s);
    {
      // Told down while it computed: its answer does not count (as a wire's would be lost).
      std::lock_guard<std::mutex> down_lock(mu_);
      RETURN_IF_ERROR(DownLocked(dispatch));
    }
    if (absl::Now() > deadline)  // computed in process: the deadline is checked, not enforced
      return absl::DeadlineExceededError(absl::StrCat(
          "step ", dispatch.step_id, ": rank ", part.rank, " did not answer before the deadline"));
    RankStepStats stats;
    stats.compute_us = absl::ToInt64Microseconds(absl::Now() - t0);
    std::set<int32_t> active(part.assignments->local_experts.begin(),
                             part.assignments->local_experts.end());
    stats.active_experts = static_cast<int>(active.size());
    if (absl::Status consumed = consume(i, *partial, stats); !consumed.ok()) return consumed;
  }
  return absl::OkStatus();
}

void LoopbackTransport::Abandon(uint64_t step_id) {
  std::lock_guard<std::mutex> lock(mu_);
  sent_.erase(step_id);
}

}  // namespace moe
