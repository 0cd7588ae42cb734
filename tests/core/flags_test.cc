// Flags: values, errors, and the generic --help / --version.
#include "core/flags.h"

#include <string>
#include <vector>

#include "core/version.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

absl::Status ParseArgs(Flags& flags, std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return flags.Parse(static_cast<int>(argv.size()), argv.data());
}

TEST(FlagsTest, ValuesErrorsAndVersion) {
  int64_t port = 50051;
  std::string name;
  Flags flags("usage: tool");
  flags.Int("port", &port, "port");
  flags.String("name", &name, "name");
  EXPECT_TRUE(ParseArgs(flags, {"/usr/bin/tool", "--port", "7", "--name=x"}).ok());
  EXPECT_EQ(port, 7);
  EXPECT_EQ(name, "x");
  EXPECT_EQ(ParseArgs(flags, {"tool", "--port", "seven"}).message(),
            "--port: cannot parse 'seven'");
  EXPECT_EQ(ParseArgs(flags, {"tool", "--bogus"}).message(), "unknown flag --bogus");

  ::testing::internal::CaptureStdout();
  const absl::Status version = ParseArgs(flags, {"/usr/bin/tool", "--version"});
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_TRUE(absl::IsCancelled(version));
  EXPECT_EQ(out, std::string("tool ") + Version() + " (commit " + GitCommit() + ")\n");
  EXPECT_NE(std::string(Version()), "unknown") << "the project version is compiled in";
}

}  // namespace
}  // namespace moe
