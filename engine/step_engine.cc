#include "engine/step_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status.h"

namespace moe {
namespace {

// Workspace slots of one layer's step; rank row buffers follow kRankRows.
enum Slot { kInput, kExpertInput, kShared, kCombined, kOutput, kRankRows };

}  // namespace

absl::StatusOr<std::unique_ptr<StepEngine>> StepEngine::Create(
    const Checkpoint& checkpoint, const std::vector<int>& layers, ExpertPlacement placement,
    Precision precision, Backend* backend, GatewayTransport* transport,
    const Membership* membership, Progress* progress) {
  std::unique_ptr<StepEngine> engine(new StepEngine());
  engine->config_ = checkpoint.config();
  engine->precision_ = precision;
  engine->backend_ = backend;
  engine->transport_ = transport;
  engine->membership_ = membership;
  if (placement.num_experts != engine->config_.routing.num_experts)
    return absl::InvalidArgumentError(absl::StrCat("placement covers ", placement.num_experts,
                                                   " experts, the model has ",
                                                   engine->config_.routing.num_experts));
  engine->rank_generations_.assign(placement.num_ranks(), {1});
  engine->placement_ =
      std::make_shared<const PlacementGeneration>(PlacementGeneration{1, std::move(placement)});
  int index = 0;
  for (int layer : layers) {
    ++index;
    auto state = std::make_unique<LayerState>();
    ASSIGN_OR_RETURN(GatewayLayerWeights weights, checkpoint.LoadGatewayLayer(layer));
    ASSIGN_OR_RETURN(state->math, GatewayLayer::Create(engine->config_, weights, backend));
    state->bias = state->math->router_bias();
    state->workspace = std::make_unique<Workspace>(backend);
    engine->layers_[layer] = std::move(state);
    if (progress != nullptr) {
      // Loaded (mapped, value-checked, prepared): the estimate is this layer's size for those to
      // come.
      const int64_t bytes = weights.TotalBytes();
      progress->SetTotal(progress->done() +
                         bytes * (static_cast<int64_t>(layers.size()) - index + 1));
      progress->Add(bytes, absl::StrCat("layer ", layer, " (", index, "/", layers.size(), ")"));
    }
  }
  if (progress != nullptr) progress->Finish();
  return engine;
}

std::shared_ptr<const PlacementGeneration> StepEngine::placement() const {
  std::lock_guard<std::mutex> lock(placement_mu_);
  return placement_;
}

std::shared_ptr<const PlacementGeneration> StepEngine::SwitchPlacement(ExpertPlacement next,
                                                                       uint64_t generation) {
  std::lock_guard<std::mutex> lock(placement_mu_);
  auto previous = placement_;
  placement_ = std::make_shared<const PlacementGeneration>(PlacementGeneration{
      generation != 0 ? generation : previous->generation + 1, std::move(next)});
  return previous;
}

void StepEngine::SetRankGenerations(int rank, std::vector<uint64_t> generations) {
  std::lock_guard<std::mutex> lock(placement_mu_);
  if (rank >= 0 && rank < static_cast<int>(rank_generations_.size()))
    rank_generations_[rank] = std::move(generations);
}

void StepEngine::AddRankGeneration(int rank, uint64_t generation) {
  std::lock_guard<std::mutex> lock(placement_mu_);
  if (rank < 0 || rank >= static_cast<int>(rank_generations_.size())) return;
  auto& held = rank_generations_[rank];
  if (std::find(held.begin(), held.end(), generation) == held.end()) held.push_back(generation);
}

bool StepEngine::RankHolds(int rank, uint64_t generation) const {
  std::lock_guard<std::mutex> lock(placement_mu_);
  if (rank < 0 || rank >= static_cast<int>(rank_generations_.size())) return false;
  const auto& held = rank_generations_[rank];
  return std::find(held.begin(), held.end(), generation) != held.end();
}

bool StepEngine::RankServes(int rank) const {
  return membership_->IsUp(rank) && RankHolds(rank, placement()->generation);
}

std::vector<int> StepEngine::layers() const {
  std::vector<int> out;
  for (const auto& [layer, state] : layers_) out.push_back(layer);
  return out;
}

GatewayLayer* StepEngine::layer(int index) {
  auto it = layers_.find(index);
  return it == layers_.end() ? nullptr : it->second->math.get();
}

std::vector<float> StepEngine::RouterBias(int layer) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return {};
  std::lock_guard<std::mutex> lock(it->second->bias_mu);
  return it->second->bias;
}

absl::Status StepEngine::SetRouterBias(int layer, std::vector<float> bias) {
  auto it = layers_.find(layer);
  if (it == layers_.end())
    return absl::NotFoundError(absl::StrCat("layer ", layer, " is not served"));
  if (static_cast<int>(bias.size()) != config_.routing.num_experts)
    return absl::InvalidArgumentError(absl::StrCat(
        "router bias has ", bias.size(), " entries, expected ", config_.routing.num_experts));
  std::lock_guard<std::mutex> lock(it->second->bias_mu);
  it->second->bias = std::move(bias);
  it->second->bias_pending = true;
  return absl::OkStatus();
}

absl::Status StepEngine::InstallPendingBias(LayerState& state) {
  std::lock_guard<std::mutex> bias_lock(state.bias_mu);
  if (!state.bias_pending) return absl::OkStatus();
  RETURN_IF_ERROR(state.math->SetRouterBias(state.bias));
  state.bias_pending = false;
  return absl::OkStatus();
}

int64_t StepEngine::MarkLostRanks(const StepDispatch& dispatch, uint64_t generation,
                                  std::vector<bool>* live) const {
  int64_t lost_rows = 0;
  // Lost: down, or no longer holding the step's placement (it came back with a newer one).
  for (const RankPart& part : dispatch.parts)
    if (!membership_->IsUp(part.rank) || !RankHolds(part.rank, generation)) {
      (*live)[part.rank] = false;
      lost_rows += part.rows.rows;
    }
  return lost_rows;
}

absl::Status StepEngine::FailStep(StepStats& stats, absl::Time t0, absl::Status status) {
  stats.ok = false;
  stats.total = absl::Now() - t0;
  if (observer_ != nullptr) observer_->OnStep(stats);
  return status;
}

absl::Status StepEngine::GatherParts(const DispatchPlan& plan, MatrixView expert_input,
                                     Workspace& ws, StepDispatch* dispatch,
                                     std::vector<int64_t>* rank_rows) {
  const int R = static_cast<int>(plan.ranks.size());
  rank_rows->assign(R, 0);
  for (int r = 0; r < R; ++r) {
    const RankDispatch& rd = plan.ranks[r];
    const int64_t m = static_cast<int64_t>(rd.token_rows.size());
    (*rank_rows)[r] = m;
    if (m == 0) continue;
    // In the wire's dtype: a bf16 step's rows are bf16 from here into the rank's GEMMs.
    ASSIGN_OR_RETURN(MutableActivationView rows,
                     ws.Activations(kRankRows + r, dispatch->precision, m, expert_input.cols));
    RETURN_IF_ERROR(backend_->GatherRows(expert_input, rd.token_rows, rows));
    dispatch->parts.push_back({r, rows, &rd.assignments});
  }
  return absl::OkStatus();
}

absl::Status StepEngine::RunStep(int layer, const ActivationRows& x, absl::Time deadline,
                                 ActivationRows* out, Routing* routing_out, StepStats* stats_out,
                                 UnservedTokens* unserved) {
  const Precision precision = x.precision();
  const int64_t tokens = x.rows();
  if (x.cols() != config_.hidden_size)
    return absl::InvalidArgumentError(absl::StrCat(
        "step input has ", x.cols(), " columns, the hidden size is ", config_.hidden_size));
  auto it = layers_.find(layer);
  if (it == layers_.end())
    return absl::NotFoundError(absl::StrCat("layer ", layer, " is not served"));
  LayerState& state = *it->second;
  std::lock_guard<std::mutex> lock(state.mu);
  RETURN_IF_ERROR(InstallPendingBias(state));
  Workspace& ws = *state.workspace;
  const int64_t H = config_.hidden_size, D = config_.expert_input_size();
  // The step's placement, held to its end (a re-placement waits for it before the ranks drop
  // this generation's experts).
  const std::shared_ptr<const PlacementGeneration> placement = this->placement();
  const int R = placement->placement.num_ranks();
  const absl::Time t0 = absl::Now();
  StepStats stats;
  stats.layer = layer;
  stats.tokens = tokens;
  stats.step_id = next_step_id_.fetch_add(1);

  // Route and project.
  // bf16 rows are the layer's input as docs/DESIGN.md defines it (x is bf16): nothing to round.
  ASSIGN_OR_RETURN(MatrixView input, ws.Matrix(kInput, tokens, H));
  RETURN_IF_ERROR(backend_->UploadRows(x, input));
  Routing routing;
  std::vector<float> scores;
  const bool want_scores = observer_ != nullptr && observer_->WantsRouterScores();
  ASSIGN_OR_RETURN(MatrixView expert_input, ws.Matrix(kExpertInput, tokens, D));
  RETURN_IF_ERROR(
      state.math->Route(input, precision, &routing, expert_input, want_scores ? &scores : nullptr));
  const absl::Time t_routed = absl::Now();

  // Dispatch to live ranks: each gets the rows of the tokens that chose one of its experts,
  // once. A step that fails because a rank that got rows went down meanwhile is sent again,
  // to live replicas of the same experts, until its deadline; the result is the same bits
  // whichever replica computes an expert (fp64 combine).
  std::vector<bool> live(R);
  for (int r = 0; r < R; ++r) live[r] = membership_->IsUp(r) && RankHolds(r, placement->generation);
  ASSIGN_OR_RETURN(MatrixView shared, ws.Matrix(kShared, tokens, H));
  ASSIGN_OR_RETURN(PartialView combined, ws.Partial(kCombined, tokens, D));
  stats.rank_active_experts.assign(R, 0);
  stats.rank_bytes_sent.assign(R, 0);
  stats.rank_bytes_received.assign(R, 0);
  DispatchPlan plan;
  StepDispatch dispatch;
  absl::Status status;
  bool shared_done = false;
  int bad_rank = -1;  // the first rank whose partial sums were not finite (host backends)
  absl::Time t_sent = t_routed, t_collected = t_routed;
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<DispatchPlan> built =
        DispatchPlan::Build(routing, placement->placement, &live,
                            unserved != nullptr ? &unserved->segment_ends : nullptr);
    if (built.ok() && static_cast<int64_t>(built->unserved_tokens.size()) == tokens)
      built = built->UnavailableStatus();  // nothing left to serve
    if (!built.ok()) {
      // After a failed attempt, say both what failed and why the step cannot go elsewhere.
      status = attempt == 0 ? built.status()
                            : absl::UnavailableError(
                                  absl::StrCat(status.message(), "; ", built.status().message()));
      break;
    }
    plan = std::move(*built);
    dispatch = StepDispatch();
    dispatch.step_id = attempt == 0 ? stats.step_id : next_step_id_.fetch_add(1);
    dispatch.layer = layer;
    dispatch.precision = precision;
    dispatch.placement_generation = placement->generation;
    RETURN_IF_ERROR(GatherParts(plan, expert_input, ws, &dispatch, &stats.rank_rows));
    status = transport_->Send(dispatch);
    t_sent = absl::Now();
    if (!shared_done) {  // the shared experts run while the ranks compute, once
      const absl::Time t_shared_start = absl::Now();
      RETURN_IF_ERROR(state.math->SharedExperts(input, precision, shared));
      stats.shared = absl::Now() - t_shared_start;
      shared_done = true;
    }
    if (status.ok()) status = backend_->Zero(combined);
    bad_rank = -1;
    if (status.ok()) {
      status = transport_->Collect(
          dispatch, deadline,
          [&](size_t part, ConstPartialView partial, const RankStepStats& rank_stats) {
            const int rank = dispatch.parts[part].rank;
            stats.rank_active_experts[rank] = rank_stats.active_experts;
            stats.rank_bytes_sent[rank] = rank_stats.bytes_sent;
            stats.rank_bytes_received[rank] = rank_stats.bytes_received;
            if (bad_rank < 0 && backend_->space() == MemorySpace::kHost)
              for (int64_t row = 0; row < partial.rows && bad_rank < 0; ++row)
                if (FirstNonFinite(partial.Row(row), partial.cols) >= 0) bad_rank = rank;
            return backend_->ScatterAddRows(partial, plan.ranks[rank].token_rows, combined);
          });
    }
    t_collected = absl::Now();
    if (status.ok()) break;
    transport_->Abandon(dispatch.step_id);
    const int64_t lost_rows = MarkLostRanks(dispatch, placement->generation, &live);
    if (lost_rows == 0 || absl::Now() >= deadline || attempt >= R) break;
    ++stats.failovers;
    stats.redispatched_rows += lost_rows;
  }
  if (!status.ok()) return FailStep(stats, t0, status);

  ASSIGN_OR_RETURN(MatrixView output, ws.Matrix(kOutput, tokens, H));
  RETURN_IF_ERROR(state.math->Finish(combined, shared, precision, output));
  RETURN_IF_ERROR(backend_->DownloadRows(output, precision, out));
  if (unserved != nullptr) {
    // Rows without their routed experts are no results: zeroed, so none can pass for one.
    unserved->tokens = plan.unserved_tokens;
    unserved->status = plan.UnavailableStatus();
    for (int64_t t : plan.unserved_tokens) out->ZeroRows(t, 1);
  }
  // Inputs are finite (validated), so a NaN or Inf here is a fault (bad weights, a faulty or
  // hostile rank, a kernel bug): never answered as OK. One pass over the output, beside a step.
  if (const int64_t at = out->FirstNonFinite(); at >= 0) {
    const std::string culprit =
        bad_rank >= 0 ? absl::StrCat("rank ", bad_rank, " returned non-finite partial sums")
                      : "no rank's partial sums were non-finite: the gateway's own part "
                        "(router, shared experts, projections) or a device rank";
    const std::string message =
        absl::StrCat("layer ", layer, " step ", stats.step_id, ": non-finite output (token ",
                     at / H, ", column ", at % H, "); ", culprit);
    LogLine("moe: %s", message.c_str());
    return FailStep(stats, t0, absl::InternalError(message));
  }
  const absl::Time t_done = absl::Now();
  stats.route = t_routed - t0;
  stats.dispatch = t_sent - t_routed;
  stats.expert_compute = t_collected - t_sent;  // overlapping the shared experts
  stats.finish = t_done - t_collected;
  stats.total = t_done - t0;
  stats.routing = &routing;
  if (want_scores) stats.router_scores = &scores;
  if (observer_ != nullptr) observer_->OnStep(stats);
  if (stats_out != nullptr) {
    *stats_out = stats;
    stats_out->routing = nullptr;
    stats_out->router_scores = nullptr;
  }
  if (routing_out != nullptr) *routing_out = std::move(routing);
  return absl::OkStatus();
}

}  // namespace moe
