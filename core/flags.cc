#include "core/flags.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/status.h"
#include "core/version.h"

namespace moe {
namespace {

// argv[0] without its directory: what errors and --version call the program.
std::string ProgramName(int argc, char** argv) {
  const std::string path = argc > 0 ? argv[0] : "moe";
  return path.substr(path.find_last_of('/') + 1);
}

}  // namespace

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

void Flags::Range(const std::string& name, int64_t min, int64_t max) { ranges_[name] = {min, max}; }

void Flags::Port(const std::string& name, int* value, const std::string& help, bool off) {
  Int(name, value, help);
  Range(name, off ? -1 : 0, 65535);
}

int64_t Flags::IntValue(const Flag& flag) const {
  return flag.kind == Kind::kInt ? *static_cast<const int*>(flag.target)
                                 : *static_cast<const int64_t*>(flag.target);
}
void Flags::AddChoice(const std::string& name, const std::string& help,
                      std::vector<std::string> choices, const std::string& default_name,
                      std::function<void(size_t)> set_choice) {
  Flag flag{Kind::kChoice, nullptr, absl::StrCat(help, " (", absl::StrJoin(choices, ", "), ")"),
            default_name};
  flag.choices = std::move(choices);
  flag.set_choice = std::move(set_choice);
  flags_[name] = std::move(flag);
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
      ok = absl::SimpleAtod(value, static_cast<double*>(flag.target)) &&
           std::isfinite(*static_cast<double*>(flag.target));
      break;
    case Kind::kBool:
      ok = absl::SimpleAtob(value, static_cast<bool*>(flag.target));
      break;
    case Kind::kChoice: {
      const auto it = std::find(flag.choices.begin(), flag.choices.end(), value);
      if (it == flag.choices.end())
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": '", value, "' is not one of ",
                                                       absl::StrJoin(flag.choices, ", ")));
      flag.set_choice(static_cast<size_t>(it - flag.choices.begin()));
      break;
    }
  }
  if (!ok)
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": cannot parse '", value, "'"));
  flag.set = true;
  return absl::OkStatus();
}

absl::Status Flags::Parse(int argc, char** argv, int first) {
  const std::string program = ProgramName(argc, argv);
  std::vector<std::string> args(argv + std::min(first, argc), argv + argc);
  RETURN_IF_ERROR(ParseArgs(args, program, 0));
  for (const auto& name : required_)
    if (!WasSet(name)) return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  for (const auto& [name, range] : ranges_) {
    auto it = flags_.find(name);
    if (it == flags_.end() || (it->second.kind != Kind::kInt && it->second.kind != Kind::kInt64))
      return absl::InternalError(absl::StrCat("Range() on --", name, ", which is no int flag"));
    if (!it->second.set) continue;  // a default may be a sentinel ("the preset's")
    const int64_t v = IntValue(it->second);
    if (v < range.first || v > range.second)
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " must be in ", range.first, "..", range.second, ", got ", v));
  }
  return absl::OkStatus();
}

absl::Status Flags::ParseArgs(const std::vector<std::string>& args, const std::string& program,
                              int depth) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    // --helpfull as absl/flags users type it: there are no library flags, so it is --help.
    if (arg == "--help" || arg == "-h" || arg == "--helpfull") {
      std::fputs(Usage().c_str(), stdout);
      return absl::CancelledError("help");
    }
    if (arg == "--version") {
      std::printf("%s %s (commit %s)\n", program.c_str(), Version(), GitCommit());
      return absl::CancelledError("version");
    }
    if (arg.rfind("--", 0) != 0 || arg == "--") {
      if (!allow_positional_)
        return absl::InvalidArgumentError(
            absl::StrCat("unexpected argument '", arg, "' (flags start with --)"));
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
    if (name == "flagfile") {
      if (!has_value) {
        if (i + 1 >= args.size()) return absl::InvalidArgumentError("--flagfile needs a value");
        value = args[++i];
      }
      if (depth > 0) return absl::InvalidArgumentError("--flagfile inside a flag file");
      std::ifstream in(value);
      if (!in) return absl::InvalidArgumentError(absl::StrCat("--flagfile: cannot read ", value));
      // One flag per line ("--name=value" or "--name value"); blank lines and # comments skipped.
      std::vector<std::string> lines;
      for (std::string line; std::getline(in, line);) {
        const absl::string_view stripped = absl::StripAsciiWhitespace(line);
        if (stripped.empty() || stripped[0] == '#') continue;
        const size_t space = stripped.find_first_of(" \t");
        const bool spaced = space != absl::string_view::npos &&
                            stripped.substr(0, space).find('=') == absl::string_view::npos;
        lines.emplace_back(spaced ? stripped.substr(0, space) : stripped);
        if (spaced) lines.emplace_back(absl::StripAsciiWhitespace(stripped.substr(space)));
      }
      RETURN_IF_ERROR(ParseArgs(lines, program, depth + 1));
      continue;
    }
    auto it = flags_.find(name);
    if (it == flags_.end())
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    if (!has_value) {
      if (it->second.kind == Kind::kBool) {
        value = "true";
      } else {
        if (i + 1 >= args.size())
          return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
        value = args[++i];
      }
    }
    if (auto s = Assign(name, it->second, value); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void Flags::ParseOrExit(int argc, char** argv, int first) {
  absl::Status s = Parse(argc, argv, first);
  if (s.ok()) return;
  if (absl::IsCancelled(s)) std::exit(0);
  const std::string program = ProgramName(argc, argv);
  std::fprintf(stderr, "%s: %s (see --help)\n", program.c_str(), std::string(s.message()).c_str());
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
    if (auto r = ranges_.find(name); r != ranges_.end())
      absl::StrAppend(&def, " [", r->second.first, "..", r->second.second, "]");
    absl::StrAppendFormat(&out, "  --%-22s %s%s\n", name, f.help, def);
  }
  out +=
      "\n--help prints this; --version prints the version and git commit; --flagfile FILE reads\n"
      "flags from FILE, one per line.\n";
  return out;
}

}  // namespace moe
