// Minimal command-line flags for the project's binaries: `--name value` or `--name=value`,
// booleans as `--name`. Unknown flags and bad values are usage errors (exit code 2).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

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
  // Marks flags that must be given.
  void Require(const std::string& name) { required_.push_back(name); }

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
  enum class Kind { kString, kInt64, kInt, kDouble, kBool };
  struct Flag {
    Kind kind;
    void* target;
    std::string help;
    std::string default_text;
    bool set = false;
  };
  absl::Status Assign(const std::string& name, Flag& flag, const std::string& value);

  std::string usage_;
  std::map<std::string, Flag> flags_;
  std::vector<std::string> order_;
  std::vector<std::string> required_;
  std::vector<std::string> positional_;
};

}  // namespace moe
