// Which ranks are up, from one source: the control plane (server/control) marks a rank up when
// its exchange with this gateway opens and down when that exchange ends or falls silent; the
// step engine plans only over live ranks, the transports (pure data planes) are told each
// change, and readiness follows it. Loopback and tests own one of their own.
#pragma once

#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace moe {

class Membership {
 public:
  explicit Membership(int num_ranks, bool up = false);

  int size() const { return static_cast<int>(up_.size()); }
  bool IsUp(int rank) const;
  int num_up() const;
  // Marks `rank` up or down; a change (not a repeat) is told to every listener, outside the
  // lock, in the order the changes happened.
  void SetUp(int rank);
  void SetDown(int rank, const std::string& why);

  using Listener = std::function<void(int rank, bool up, const std::string& why)>;
  void Subscribe(Listener listener);  // before any change

 private:
  void Set(int rank, bool up, const std::string& why);

  mutable std::mutex mu_;
  std::vector<bool> up_;  // guarded by mu_
  std::vector<Listener> listeners_;
  std::mutex notify_mu_;  // listeners hear one change at a time
};

}  // namespace moe
