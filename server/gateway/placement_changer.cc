#include "server/gateway/placement_changer.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/log.h"

namespace moe {
namespace {

// A rank's error text goes into the log and to the caller of ApplyPlacement: escaped (no
// forged log lines) and cut, as the bias-override source is.
std::string RankText(const std::string& text) {
  return absl::CEscape(absl::string_view(text).substr(0, 512));
}

}  // namespace

using moe::v1::internal::GatewayToRank;

PlacementChanger::PlacementChanger(StepEngine* engine, RankControlChannel* ranks,
                                   std::function<void()> on_change,
                                   std::function<void(const PlacementGeneration&)> on_follow)
    : engine_(engine),
      ranks_(ranks),
      on_change_(std::move(on_change)),
      on_follow_(std::move(on_follow)),
      follower_([this] { FollowLoop(); }) {}

PlacementChanger::~PlacementChanger() {
  Stop();
  follower_.join();
}

void PlacementChanger::OnOffer(int rank, const moe::v1::internal::PlacementOffer& offer) {
  if (offer.generation() <= engine_->placement()->generation) return;
  std::lock_guard<std::mutex> lock(mu_);
  offers_[offer.generation()][rank].assign(offer.experts().begin(), offer.experts().end());
  // What an authenticated rank can make this hold: a few generations ahead, no more.
  while (offers_.size() > 4) offers_.erase(offers_.begin());
  cv_.notify_all();
}

void PlacementChanger::FollowLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    const int R = engine_->placement()->placement.num_ranks();
    const uint64_t current = engine_->placement()->generation;
    auto complete = offers_.end();
    for (auto it = offers_.begin(); it != offers_.end(); ++it)
      if (it->first > current && static_cast<int>(it->second.size()) == R) complete = it;
    if (stopped_) return;
    if (complete == offers_.end()) {
      cv_.wait_for(lock, std::chrono::milliseconds(200));
      continue;
    }
    const uint64_t generation = complete->first;
    std::vector<std::vector<int>> rank_experts(R);
    for (auto& [rank, experts] : complete->second)
      if (rank >= 0 && rank < R) rank_experts[rank] = std::move(experts);
    offers_.erase(offers_.begin(), std::next(complete));
    lock.unlock();
    absl::StatusOr<ExpertPlacement> next = ExpertPlacement::FromRankExperts(
        engine_->placement()->placement.num_experts, std::move(rank_experts));
    if (next.ok()) {
      Follow(PlacementGeneration{generation, std::move(*next)});
    } else {
      LogLine("moe-gateway: ranks offered placement generation %llu, unusable: %s",
              static_cast<unsigned long long>(generation),
              std::string(next.status().message()).c_str());
    }
    lock.lock();
  }
}

void PlacementChanger::Follow(PlacementGeneration next) {
  std::lock_guard<std::mutex> apply_lock(apply_mu_);  // never inside this gateway's own change
  std::shared_ptr<const PlacementGeneration> current = engine_->placement();
  if (next.generation <= current->generation) return;
  const int R = current->placement.num_ranks();
  for (int r = 0; r < R; ++r) engine_->AddRankGeneration(r, next.generation);
  current.reset();
  const PlacementGeneration followed = next;
  std::weak_ptr<const PlacementGeneration> old =
      engine_->SwitchPlacement(std::move(next.placement), next.generation);
  while (!old.expired()) absl::SleepFor(absl::Milliseconds(1));
  for (int r = 0; r < R; ++r) Keep(r, followed.generation);
  LogLine(
      "moe-gateway: serving placement generation %llu (another gateway's change, "
      "offered by every rank)",
      static_cast<unsigned long long>(followed.generation));
  if (on_follow_) on_follow_(followed);
  if (on_change_) on_change_();
}

GatewayToRank PlacementChanger::LoadMessage(const PlacementGeneration& placement, int rank) const {
  GatewayToRank message;
  auto* load = message.mutable_load_shards();
  load->set_generation(placement.generation);
  for (int layer : engine_->layers()) {
    auto* shard = load->add_shards();
    shard->set_layer(layer);
    for (int e : placement.placement.rank_experts[rank]) shard->add_experts(e);
  }
  return message;
}

void PlacementChanger::Keep(int rank, uint64_t generation) {
  GatewayToRank message;
  message.mutable_keep_shards()->set_generation(generation);
  Send(rank, message, "KeepShards");
  engine_->SetRankGenerations(rank, {generation});
}

void PlacementChanger::Send(int rank, const GatewayToRank& message, const char* what) {
  // A rank down now registers again and is told the generation in use then; a rank whose
  // stream broke in between is being marked down: neither is an error of the change.
  if (absl::Status s = ranks_->SendControl(rank, message); !s.ok()) {
    LogLine(
        "moe-gateway: %s not sent to rank %d (%s): it gets the placement in use "
        "when it registers again",
        what, rank, std::string(s.message()).c_str());
  }
}

void PlacementChanger::CatchUp(int rank) {
  const auto current = engine_->placement();
  if (engine_->RankHolds(rank, current->generation)) return;
  LogLine("moe-gateway: rank %d loads placement generation %llu", rank,
          static_cast<unsigned long long>(current->generation));
  Send(rank, LoadMessage(*current, rank), "LoadShards");
}

void PlacementChanger::OnHello(int rank, uint64_t generation) {
  engine_->SetRankGenerations(rank, {generation});
}

void PlacementChanger::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  stopped_ = true;
  cv_.notify_all();
}

void PlacementChanger::OnRankDown(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  cv_.notify_all();
}

void PlacementChanger::OnShardsLoaded(int rank, const moe::v1::internal::ShardsLoaded& loaded) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_ != 0 && loaded.generation() == pending_) {
      answers_[rank] = loaded;
      cv_.notify_all();
      return;
    }
  }
  // A catch-up load (the rank came back with an older generation), or a change called off.
  const uint64_t current = engine_->placement()->generation;
  if (loaded.generation() == current && loaded.code() == 0) {
    Keep(rank, current);
    LogLine("moe-gateway: rank %d serves placement generation %llu", rank,
            static_cast<unsigned long long>(current));
    if (on_change_) on_change_();
    return;
  }
  if (loaded.generation() == current)
    LogLine("moe-gateway: rank %d could not load placement generation %llu: %s", rank,
            static_cast<unsigned long long>(current), RankText(loaded.error()).c_str());
  GatewayToRank keep;  // whatever it loaded is not wanted: drop it
  keep.mutable_keep_shards()->set_generation(current);
  Send(rank, keep, "KeepShards");
}

absl::StatusOr<PlacementChange> PlacementChanger::Apply(ExpertPlacement next,
                                                        absl::Duration load_timeout) {
  std::unique_lock<std::mutex> apply_lock(apply_mu_, std::try_to_lock);
  if (!apply_lock.owns_lock()) return absl::AbortedError("another placement change is running");
  const absl::Time t0 = absl::Now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return absl::CancelledError("the gateway is shutting down");
  }
  std::shared_ptr<const PlacementGeneration> current = engine_->placement();
  const uint64_t old_generation = current->generation;
  const int R = current->placement.num_ranks();
  if (next.num_ranks() != R || next.num_experts != current->placement.num_experts)
    return absl::InvalidArgumentError(absl::StrCat(
        "the placement has ", next.num_ranks(), " ranks and ", next.num_experts,
        " experts; the gateway serves ", R, " ranks and ", current->placement.num_experts));
  PlacementGeneration staged{current->generation + 1, next};
  PlacementChange change;
  change.generation = staged.generation;

  // 1. Load beside the serving shards.
  std::vector<int> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = staged.generation;
    answers_.clear();
  }
  for (int r = 0; r < R; ++r) {
    if (ranks_->IsUp(r) && ranks_->SendControl(r, LoadMessage(staged, r)).ok()) {
      targets.push_back(r);
    } else {
      change.ranks_down.push_back(r);
    }
  }
  absl::Status failed;
  {
    std::unique_lock<std::mutex> lock(mu_);
    const absl::Time deadline = absl::Now() + load_timeout;
    for (;;) {
      if (stopped_) {
        failed = absl::CancelledError("the gateway is shutting down");
        break;
      }
      bool waiting = false;
      for (int r : targets)
        if (answers_.count(r) == 0 && ranks_->IsUp(r)) waiting = true;
      if (!waiting) break;
      if (absl::Now() >= deadline) {
        failed = absl::UnavailableError(absl::StrCat("ranks did not load placement generation ",
                                                     staged.generation, " within ",
                                                     absl::FormatDuration(load_timeout)));
        break;
      }
      cv_.wait_for(lock, std::chrono::milliseconds(50));
    }
    pending_ = 0;
    for (int r : targets) {
      auto it = answers_.find(r);
      if (it == answers_.end()) {
        change.ranks_down.push_back(r);
      } else if (it->second.code() != 0) {
        if (failed.ok())
          failed = absl::UnavailableError(
              absl::StrCat("rank ", r, " could not load placement generation ", staged.generation,
                           ": ", RankText(it->second.error())));
      } else {
        change.ranks_loaded.push_back(r);
        change.slowest_load =
            std::max(change.slowest_load, absl::Seconds(it->second.load_seconds()));
      }
    }
  }
  std::sort(change.ranks_down.begin(), change.ranks_down.end());
  for (int r : change.ranks_loaded) engine_->AddRankGeneration(r, staged.generation);

  // Every expert must keep a live replica through the switch.
  if (failed.ok()) {
    std::vector<int> missing;
    for (int e = 0; e < staged.placement.num_experts; ++e) {
      bool covered = false;
      for (const auto& replica : staged.placement.replicas[e])
        covered = covered || (ranks_->IsUp(replica.rank) &&
                              engine_->RankHolds(replica.rank, staged.generation));
      if (!covered) missing.push_back(e);
    }
    if (!missing.empty()) {
      if (missing.size() > 16) missing.resize(16);
      failed = absl::UnavailableError(
          absl::StrCat("placement generation ", staged.generation,
                       " would leave experts without a live replica: ", absl::StrJoin(missing, ","),
                       missing.size() == 16 ? ",..." : ""));
    }
  }
  if (!failed.ok()) {
    for (int r : targets) Keep(r, old_generation);
    LogLine("moe-gateway: placement change called off: %s", std::string(failed.message()).c_str());
    return failed;
  }

  // 2. Switch at a step boundary, 3. release once the old generation's steps are done.
  current.reset();  // only the steps in flight hold the old generation now
  std::weak_ptr<const PlacementGeneration> old = engine_->SwitchPlacement(std::move(next));
  while (!old.expired()) absl::SleepFor(absl::Milliseconds(1));
  for (int r = 0; r < R; ++r)
    if (engine_->RankHolds(r, staged.generation)) Keep(r, staged.generation);
  for (int r = 0; r < R; ++r)
    if (ranks_->IsUp(r)) CatchUp(r);  // came up during the change with the old one
  change.took = absl::Now() - t0;
  LogLine(
      "moe-gateway: serving placement generation %llu (ranks loaded: %s; down: %s) "
      "after %.3f s",
      static_cast<unsigned long long>(change.generation),
      absl::StrJoin(change.ranks_loaded, ",").c_str(),
      change.ranks_down.empty() ? "none" : absl::StrJoin(change.ranks_down, ",").c_str(),
      absl::ToDoubleSeconds(change.took));
  if (on_change_) on_change_();
  return change;
}

}  // namespace moe
