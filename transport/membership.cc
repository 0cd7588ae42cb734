#include "transport/membership.h"

namespace moe {

Membership::Membership(int num_ranks, bool up) : up_(static_cast<size_t>(num_ranks), up) {}

bool Membership::IsUp(int rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  return rank >= 0 && rank < static_cast<int>(up_.size()) && up_[rank];
}

int Membership::num_up() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (bool up : up_) n += up;
  return n;
}

void Membership::SetUp(int rank) { Set(rank, true, ""); }
void Membership::SetDown(int rank, const std::string& why) { Set(rank, false, why); }

void Membership::Subscribe(Listener listener) { listeners_.push_back(std::move(listener)); }

void Membership::Set(int rank, bool up, const std::string& why) {
  // Held across the change and its notification: listeners see changes in the order they were
  // made, and a reader after a listener ran sees at least that state.
  std::lock_guard<std::mutex> notify(notify_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (rank < 0 || rank >= static_cast<int>(up_.size()) || up_[rank] == up) return;
    up_[rank] = up;
  }
  for (const Listener& listener : listeners_) listener(rank, up, why);
}

}  // namespace moe
