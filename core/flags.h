// The command-line flags of every binary of the project: `--name value` or `--name=value`,
// booleans as `--name` (or `--name=false`), `--flagfile FILE` (one flag per line, # comments).
// Unknown flags, bad or out-of-range values and stray arguments are usage errors: one line on
// stderr, "<program>: <message> (see --help)", exit code 2. `--help` and `--version` are built
// in. Conventions the binaries share: ports are 1..65535 (0 = any free port where a server
// binds; --metrics-port -1 = off), thread counts >= 0 (0 = all cores).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/numerics.h"

namespace moe {

class Flags {
 public:
  // `usage` is printed by --help, above the generated flag list.
  explicit Flags(std::string usage) : usage_(std::move(usage)) {}

  void String(const std::string& name, std::string* value, const std::string& help);
  void Int(const std::string& name, int64_t* value, const std::string& help);
  void Int(const std::string& name, int* value, const std::string& help);
  void Double(const std::string& name, double* value, const std::string& help);
  void Bool(const std::string& name, bool* value, const std::string& help);
  // One of a fixed set of named values (an enum, or strings that act as one): the flag takes one
  // of the names in `choices`; anything else is refused with the list. The usage shows the
  // names and, as the default, the name of the value *value holds when this is called.
  template <typename T>
  void Choice(const std::string& name, T* value, std::vector<std::pair<std::string, T>> choices,
              const std::string& help) {
    std::vector<std::string> names;
    std::string default_name;
    for (const auto& [choice, v] : choices) {
      names.push_back(choice);
      if (v == *value) default_name = choice;
    }
    AddChoice(name, help, std::move(names), default_name,
              [value, choices = std::move(choices)](size_t i) { *value = choices[i].second; });
  }
  // Marks flags that must be given.
  void Require(const std::string& name) { required_.push_back(name); }
  // A value given for int flag `name` must lie in [min, max] (defaults may be sentinels).
  void Range(const std::string& name, int64_t min, int64_t max);
  // A listening port: 0 (any free port) or 1..65535; with `off`, also -1 (disabled).
  void Port(const std::string& name, int* value, const std::string& help, bool off = false);
  // Arguments that are not flags are kept in positional() instead of being refused.
  void AllowPositional() { allow_positional_ = true; }

  // Parses argv[first..argc). Non-flag arguments go to positional(). Returns
  // InvalidArgument with a one-line message; --help and --version return Cancelled after
  // printing the usage, or the program's version and git commit.
  absl::Status Parse(int argc, char** argv, int first = 1);
  // Parse, printing "<program>: <message> (see --help)" and exiting 2 on error (0 for --help).
  void ParseOrExit(int argc, char** argv, int first = 1);
  bool WasSet(const std::string& name) const;
  const std::vector<std::string>& positional() const { return positional_; }
  std::string Usage() const;

 private:
  enum class Kind { kString, kInt64, kInt, kDouble, kBool, kChoice };
  struct Flag {
    Kind kind;
    void* target;
    std::string help;
    std::string default_text;
    bool set = false;
    std::vector<std::string> choices;        // kChoice: the names
    std::function<void(size_t)> set_choice;  // kChoice: stores the value of choices[i]
  };
  void AddChoice(const std::string& name, const std::string& help, std::vector<std::string> choices,
                 const std::string& default_name, std::function<void(size_t)> set_choice);
  absl::Status Assign(const std::string& name, Flag& flag, const std::string& value);
  absl::Status ParseArgs(const std::vector<std::string>& args, const std::string& program,
                         int depth);
  int64_t IntValue(const Flag& flag) const;

  std::string usage_;
  std::map<std::string, Flag> flags_;
  std::vector<std::string> order_;
  std::vector<std::string> required_;
  std::vector<std::string> positional_;
  std::map<std::string, std::pair<int64_t, int64_t>> ranges_;
  bool allow_positional_ = false;
};

// --dtype's names for the forward pass's precision.
inline std::vector<std::pair<std::string, Precision>> PrecisionChoices() {
  return {{"bf16", Precision::kBF16}, {"fp32", Precision::kFP32}};
}

}  // namespace moe
