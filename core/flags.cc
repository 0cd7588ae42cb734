#include "core/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/version.h"

namespace moe {

void Flags::String(const std::string& name, std::string* value, const std::string& help) {
  flags_[name] = {Kind::kString, value, help, *value};
  order_.push_back(name);
}
void Flags::Int(const std::string& name, int64_t* value, const std::string& help) {
  flags_[name] = {Kind::kInt64, value, help, absl::StrCat(*value)};
  order_.push_back(name);
}
void Flags::Int(const std::string& name, int* value, const std::string& help) {
  flags_[name] = {Kind::kInt, value, help, absl::StrCat(*value)};
  order_.push_back(name);
}
void Flags::Double(const std::string& name, double* value, const std::string& help) {
  flags_[name] = {Kind::kDouble, value, help, absl::StrCat(*value)};
  order_.push_back(name);
}
void Flags::Bool(const std::string& name, bool* value, const std::string& help) {
  flags_[name] = {Kind::kBool, value, help, *value ? "true" : "false"};
  order_.push_back(name);
}

bool Flags::WasSet(const std::string& name) const {
  auto it = flags_.find(name);
  return it != flags_.end() && it->second.set;
}

absl::Status Flags::Assign(const std::string& name, Flag& flag, const std::string& value) {
  bool ok = true;
  switch (flag.kind) {
    case Kind::kString:
      *static_cast<std::string*>(flag.target) = value;
      break;
    case Kind::kInt64:
      ok = absl::SimpleAtoi(value, static_cast<int64_t*>(flag.target));
      break;
    case Kind::kInt:
      ok = absl::SimpleAtoi(value, static_cast<int*>(flag.target));
      break;
    case Kind::kDouble:
      ok = absl::SimpleAtod(value, static_cast<double*>(flag.target));
      break;
    case Kind::kBool:
      ok = absl::SimpleAtob(value, static_cast<bool*>(flag.target));
      break;
  }
  if (!ok)
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": cannot parse '", value, "'"));
  flag.set = true;
  return absl::OkStatus();
}

absl::Status Flags::Parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(Usage().c_str(), stdout);
      return absl::CancelledError("help");
    }
    if (arg == "--version") {
      std::string program = argc > 0 ? argv[0] : "moe";
      program = program.substr(program.find_last_of('/') + 1);
      std::printf("%s %s (commit %s)\n", program.c_str(), Version(), GitCommit());
      return absl::CancelledError("version");
    }
    if (arg.rfind("--", 0) != 0) {
      positional_.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = flags_.find(name);
    if (it == flags_.end())
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    if (!has_value) {
      if (it->second.kind == Kind::kBool) {
        value = "true";
      } else {
        if (i + 1 >= argc)
          return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
        value = argv[++i];
      }
    }
    if (auto s = Assign(name, it->second, value); !s.ok()) return s;
  }
  for (const auto& name : required_)
    if (!WasSet(name)) return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  return absl::OkStatus();
}

void Flags::ParseOrExit(int argc, char** argv, int first) {
  absl::Status s = Parse(argc, argv, first);
  if (s.ok()) return;
  if (absl::IsCancelled(s)) std::exit(0);
  std::fprintf(stderr, "%s: %s (see --help)\n", argv[0], std::string(s.message()).c_str());
  std::exit(2);
}

std::string Flags::Usage() const {
  std::string out = usage_;
  if (!out.empty() && out.back() != '\n') out += "\n";
  out += "\nflags:\n";
  for (const auto& name : order_) {
    const Flag& f = flags_.at(name);
    const bool required = std::find(required_.begin(), required_.end(), name) != required_.end();
    std::string def =
        required ? " (required)"
                 : (f.default_text.empty() ? "" : absl::StrCat(" (default ", f.default_text, ")"));
    absl::StrAppendFormat(&out, "  --%-22s %s%s\n", name, f.help, def);
  }
  out += "\n--help prints this; --version prints the version and git commit.\n";
  return out;
}

}  // namespace moe
